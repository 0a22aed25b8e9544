"""ParallelDims: the job's parallel degrees, resolved against the world size and checked.

Pure arithmetic; building the DeviceMesh lives in ``trainer.parallel.mesh`` so that the
config loader and the dry run can use this without a process group.
"""

from dataclasses import dataclass

from trainer.config.schema import Parallelism
from trainer.errors import ConfigError

_KEYS = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
}


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees; ``dp_shard`` is never -1 here."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    """Expert-parallel ranks: a factor of dp_shard (the mesh splits dp_shard into dp_shard_mod_ep x ep)."""

    @classmethod
    def from_config(cls, parallelism: Parallelism, world_size: int, world_name: str = "") -> "ParallelDims":
        """Resolve ``data_parallel_shard_degree = -1`` and check that the degrees fill the world.

        ``parallelism`` is the ``[parallelism]`` section; ``world_name`` says where the world size comes from
        in the user's words (e.g. ``NGPU 2``), default ``WORLD_SIZE <n>``.
        """
        world = world_name or f"WORLD_SIZE {world_size}"
        rep = parallelism.data_parallel_replicate_degree
        shard = parallelism.data_parallel_shard_degree
        cp = parallelism.context_parallel_degree
        tp = parallelism.tensor_parallel_degree
        pp = parallelism.pipeline_parallel_degree
        others = rep * cp * tp * pp
        if shard == -1:
            if world_size % others != 0:
                raise ConfigError(
                    f"[parallelism] degrees do not divide the world: dp_replicate {rep} * cp {cp} * tp {tp}"
                    f" * pp {pp} = {others} does not divide {world}"
                )
            shard = world_size // others
        total = rep * shard * cp * tp * pp
        if total != world_size:
            raise ConfigError(
                f"[parallelism] degrees do not match the world: dp_replicate {rep} * dp_shard {shard} * cp {cp}"
                f" * tp {tp} * pp {pp} = {total} != {world}"
            )
        ep = parallelism.expert_parallel_degree
        if ep > 1:
            if shard % ep:
                raise ConfigError(
                    f"[parallelism] expert_parallel_degree={ep} must divide data_parallel_shard_degree={shard}"
                    " (expert-parallel ranks are carved from the FSDP ranks)"
                )
            if cp > 1:
                raise ConfigError(
                    f"[parallelism] expert_parallel_degree={ep} with context_parallel_degree={cp}: not supported yet;"
                    " use one of them"
                )
        return cls(rep, shard, cp, tp, pp, world_size, ep)

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP ranks that hold the same experts (each expert's parameters are sharded over them)."""
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def plain_ddp(self) -> bool:
        """Replicas of a whole model and no other parallelism: torch's DDP reducer runs them
        (trainer.parallel.ddp); with any other degree above 1, replicas are FSDP2's replicate dimension."""
        return self.dp_replicate > 1 and self.world_size == self.dp_replicate

    def data_parallel(self) -> str:
        """What reduces gradients over the data-parallel ranks, for the dry run ("" without data parallelism)."""
        if self.plain_ddp:
            return (f"DDP over {self.dp_replicate} replicas: torch's DDP reducer, bucketed all-reduces that overlap"
                    " backward, accumulation reduced once per step")
        if self.dp * self.cp == 1:
            return ""
        shard = self.dp_shard * self.cp
        if shard == 1:
            return (f"DDP over {self.dp_replicate} replicas as FSDP2 on a (replicate {self.dp_replicate}, shard 1)"
                    " mesh, which composes with TP, CP and pipeline stages")
        what = f"FSDP2: parameters, gradients and Adam state sharded over {shard} ranks (dp_shard x cp)"
        return f"HSDP, {what}, replicated {self.dp_replicate} times" if self.dp_replicate > 1 else what

    @property
    def grad_average(self) -> int:
        """Ranks whose gradients FSDP/DDP average (data-parallel and context-parallel ranks)."""
        return self.dp * self.cp

    def describe(self) -> str:
        ep = f" (ep {self.ep} of dp_shard)" if self.ep > 1 else ""
        return " * ".join(f"{name} {getattr(self, name)}" for name in _KEYS) + f" = {self.world_size} ranks{ep}"
