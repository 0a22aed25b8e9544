"""Tensor-parallel plan entries of latent attention (trainer/models/mla.py), added to a block plan.

The heads are split: ``wq`` (or ``wq_b``) and ``wkv_b`` by column, ``wo`` by row. The low-rank projections
``wq_a`` and ``wkv_a`` and their norms stay whole on every rank, computing the same latents there; the column-wise
projections after them sum their input gradients over the ranks, so the latents' gradients are whole too. The
rotary key is the exception: all heads share it, and each rank's heads add only their part of its gradient, so
``LatentAttentionParallel`` sums that part of ``wkv_a``'s output gradient over the ranks. With sequence
parallelism it also gathers the sequence on entry (as a plain tensor: the replicated projections take no DTensor).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module


class _SumGradOfColumns(torch.autograd.Function):
    """Identity forward; backward sums the gradient of the last columns from ``start`` over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        part = grad[..., ctx.start:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start:] = part
        return grad, None, None


class LatentAttentionParallel(ParallelStyle):
    """On a block's ``attention`` when it is latent attention (a decoder Attention is left as it is)."""

    def __init__(self, *, sequence_parallel: bool, otherwise: ParallelStyle | None):
        super().__init__()
        self.sequence_parallel, self.otherwise = sequence_parallel, otherwise

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "wkv_a"):  # the decoder's attention: the plan's own entry, if any
            return parallelize_module(module, device_mesh, self.otherwise) if self.otherwise is not None else module
        group, start = device_mesh.get_group(), module.kv_lora_rank
        module.wkv_a.register_forward_hook(lambda mod, inputs, out: _SumGradOfColumns.apply(out, start, group))
        if self.sequence_parallel:
            def gather(mod, args):
                x = args[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
                # the gradient coming back is whole on every rank (see above): each keeps its part of the sequence
                return (x.redistribute(device_mesh, [Replicate()]).to_local(), *args[1:])

            module.register_forward_pre_hook(gather)
        return module


def add_latent_attention(block: dict[str, ParallelStyle], *, sequence_parallel: bool) -> None:
    """Latent attention's entries in a block plan (those of modules a block lacks are skipped)."""
    block.update({
        "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention": LatentAttentionParallel(sequence_parallel=sequence_parallel, otherwise=block.get("attention")),
    })
