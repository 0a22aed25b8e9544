"""FSDP2 (fully_shard) per block plus the top-level modules; HSDP and DDP on a 2-D mesh.

DDP composed with TP, CP or a pipeline is FSDP2 on a (replicate, shard=1) mesh: parameters
stay whole on every rank and gradients are all-reduced, but unlike torch's DDP it accepts
DTensor (tensor-parallel) parameters and pipeline chunks. Plain DDP is trainer.parallel.ddp.
"""

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.models.registry import model_blocks
from trainer.parallel.technique import ChunkSetup, Technique


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: Literal["default", "always", "never"],
    layers_attr: str,
    pre_layers: tuple[str, ...],
    post_layers: tuple[str, ...],
    pipelined: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``model`` in place: one FSDP unit per block, one for the pre- and one for the post-layers.

    ``pipelined``: under a pipeline schedule each step runs several microbatches, so by
    default parameters stay gathered between them instead of being re-gathered per microbatch.
    ``expert_mesh``: with expert parallelism, the mesh of the experts' own FSDP units.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # imports DTensor (~0.5 s): only when used

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = {"default": not pipelined, "always": True, "never": False}[reshard_after_forward]
    # Under "default", modules that backward needs first (last block, final norm, output)
    # keep their gathered parameters after forward instead of gathering them again.
    keep_last = reshard_after_forward == "default"
    blocks = list(model_blocks(model, layers_attr).values())
    if expert_mesh is not None:
        # Expert-parallel weights: their own FSDP unit over the ranks holding the same experts,
        # wrapped first so that the block's unit leaves them out.
        from trainer.parallel.ep import expert_modules

        for moe in expert_modules(model):
            fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and not (last and keep_last))
    pre = [getattr(model, n) for n in pre_layers if getattr(model, n, None) is not None]
    post = [getattr(model, n) for n in post_layers if getattr(model, n, None) is not None]
    if _share_parameters(pre, post):
        # Tied embedding and output: a shared parameter must live in exactly one FSDP unit.
        fully_shard(pre + post, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and not keep_last)
    else:
        if pre:
            fully_shard(pre, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        if post:
            fully_shard(post, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and not keep_last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def _share_parameters(a: list[nn.Module], b: list[nn.Module]) -> bool:
    ids = {id(p) for m in a for p in m.parameters()}
    return any(id(p) in ids for m in b for p in m.parameters())


class FullyShardedDataParallel(Technique):
    """FSDP2, HSDP, and DDP composed with TP, CP or a pipeline (``Meshes.fsdp``); it casts parameters to the
    compute dtype itself (mixed precision without autocast)."""

    name = "fsdp"
    casts_parameters = True

    def __init__(self, setup: ChunkSetup):
        self.mesh, self.expert_mesh, self.layout = setup.meshes.fsdp, setup.meshes.expert_fsdp, setup.layout
        self.param_dtype, self.reduce_dtype = setup.param_dtype, setup.reduce_dtype
        self.reshard, self.pipelined = setup.parallelism.fsdp_reshard_after_forward, setup.pipelined

    @classmethod
    def build(cls, setup: ChunkSetup) -> "FullyShardedDataParallel | None":
        return None if setup.meshes.fsdp is None else cls(setup)

    def apply(self, chunk: nn.Module) -> None:
        apply_fsdp(chunk, self.mesh, param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                   reshard_after_forward=self.reshard, layers_attr=self.layout.blocks,
                   pre_layers=self.layout.pre, post_layers=self.layout.post, pipelined=self.pipelined,
                   expert_mesh=self.expert_mesh)
