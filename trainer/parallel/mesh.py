"""Process group and the named DeviceMesh, plus the sub-meshes each consumer needs.

The world mesh has the dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"), pp outermost
and tp innermost, so tensor-parallel groups are neighbouring ranks (one node on GPUs).
Consumers get the sub-mesh they need from ``Meshes``; a dim of size 1 gives ``None`` and
the consumer skips its collectives.
"""

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# With expert parallelism dp_shard is split in two; the whole of dp_shard is their flattening.
EP_DIM_NAMES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


def init_distributed(device: torch.device, init_timeout_seconds: int) -> None:
    """Join the torchrun job: gloo for CPU tensors, the accelerator's backend for device tensors."""
    backend = ("gloo" if device.type == "cpu"
               else f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device)}")
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=init_timeout_seconds))


def set_train_timeout(seconds: int) -> None:
    """Switch from the generous set-up timeout to the training one, after the first step, on every
    process group this rank is in: the mesh's sub-groups (pipeline, FSDP, TP, cp) and the tied-weight
    pairs keep the timeout they were created with otherwise, and a hung peer would hold the job
    for the set-up timeout."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout, _world
    except ImportError:  # private helpers; without them the set-up timeout stays in force
        logger.warning("cannot change the process-group timeout on this torch; keeping the init timeout")
        return
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(_world.pg_map):
        _set_pg_timeout(timeout, group)


@dataclass(frozen=True)
class Meshes:
    """The sub-meshes of one job; each is None when its degree is 1 (or with one process)."""

    world: DeviceMesh | None
    dims: ParallelDims

    def _sub(self, *names: str) -> DeviceMesh | None:
        if self.world is None or all(self.dims_size(n) == 1 for n in names):
            return None
        return self.world[names] if len(names) > 1 else self.world[names[0]]

    def dims_size(self, name: str) -> int:
        return getattr(self.dims, name)

    def _local_rank(self, name: str) -> int:
        return self.world[name].get_local_rank()  # also for flattened dims (dp_shard under EP)

    @property
    def ep(self) -> DeviceMesh | None:
        return self._sub("ep")

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """Mesh of the experts' FSDP under expert parallelism: the data-parallel ranks that hold the same
        experts (dp_replicate x dp_shard_mod_ep, possibly of size 1). None without EP."""
        if self.world is None or self.dims.ep == 1:
            return None
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard_mod_ep"]
        return self.world["dp_shard_mod_ep"]

    @property
    def expert_grad_average(self) -> int:
        """Ranks over which the experts' FSDP averages their gradients (see trainer.train.train_step)."""
        return self.dims.dp_replicate * self.dims.dp_shard_mod_ep if self.dims.ep > 1 else self.dims.grad_average

    @property
    def tp(self) -> DeviceMesh | None:
        return self._sub("tp")

    @property
    def pp(self) -> DeviceMesh | None:
        return self._sub("pp")

    @property
    def cp(self) -> DeviceMesh | None:
        return self._sub("cp")

    @property
    def ddp(self) -> dist.ProcessGroup | None:
        """Group of torch's DDP reducer (trainer.parallel.ddp) when the job is plain DDP
        (``ParallelDims.plain_ddp``)."""
        if self.world is None or not self.dims.plain_ddp:
            return None
        return self.world["dp_replicate"].get_group()

    @property
    def fsdp(self) -> DeviceMesh | None:
        """Mesh handed to fully_shard: 1-D (shard) for FSDP, 2-D (replicate, shard) for HSDP and for DDP
        composed with TP, CP or a pipeline (plain DDP is ``ddp``).

        Context-parallel ranks are folded into the shard dimension ("dp_shard_cp"): they hold the
        same parameters and their gradients (each from its part of the sequences) must be summed,
        which FSDP's reduce-scatter does; sharding over them too saves memory.
        """
        if self.world is None or self.dims.dp * self.dims.cp == 1 or self.dims.plain_ddp:
            return None
        shard = "dp_shard_cp" if self.dims.cp > 1 else "dp_shard"
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", shard]
        return self.world[shard]

    @property
    def dp_rank(self) -> int:
        """Index of this rank's batch among the data-parallel ranks (cp peers share it)."""
        if self.world is None:
            return 0
        return self._local_rank("dp_replicate") * self.dims.dp_shard + self._local_rank("dp_shard")

    def batch_groups(self) -> list[dist.ProcessGroup]:
        """Process groups whose all-reduces together sum over every token of a step: the
        data-parallel ranks' batches and the context-parallel ranks' parts of each sequence."""
        if self.world is None:
            return []
        return [self.world[n].get_group() for n in ("dp_replicate", "dp_shard", "cp") if self.dims_size(n) > 1]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    if dims.world_size == 1:
        return Meshes(None, dims)
    if dims.ep > 1:
        shape = (dims.pp, dims.dp_replicate, dims.dp_shard_mod_ep, dims.ep, dims.cp, dims.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=EP_DIM_NAMES)
        world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")  # the non-expert parameters' FSDP dimension
        return Meshes(world, dims)
    shape = tuple(getattr(dims, name) for name in DIM_NAMES)
    world = init_device_mesh(device_type, shape, mesh_dim_names=DIM_NAMES)
    if dims.cp > 1:
        world["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP's shard dimension (see Meshes.fsdp)
    return Meshes(world, dims)


def all_reduce_sum(tensor: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """Sum ``tensor`` in place over the given groups (e.g. every data-parallel dim)."""
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
