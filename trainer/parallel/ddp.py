"""DDP of a whole, plain-tensor model: torch's DDP reducer attached in place (composable ``replicate``).

Used when the data-parallel ranks only replicate: ``dp_shard = cp = tp = ep = pp = 1`` (see
``Meshes.ddp``). The reducer packs gradients into buckets as backward produces them and
all-reduces each bucket asynchronously, so communication overlaps the rest of backward, and with
``gradient_as_bucket_view`` the gradients are the buckets (no copies). Every other layout with
replicas (HSDP, DDP x TP, DDP x CP, DDP under a pipeline) uses FSDP2 on a (replicate, shard) mesh,
which accepts DTensor parameters and pipeline stages; on CPU (gloo) it waits for each block's
all-reduce inside backward and copies the parameters in and out each step: at the peer
benchmark's shape its DDP 2 step was 9% longer (docs/performance.md, "Data-parallel overhead").

Parameter names are unchanged (no wrapper module), so checkpoints move freely between layouts.
Seam: ``torch.distributed._composable.replicate`` (private; checked on torch 2.13.0).
"""

import inspect

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.technique import ChunkSetup, Technique


def apply_ddp(model: nn.Module, group: dist.ProcessGroup, *, reduce_dtype: torch.dtype) -> None:
    """Make ``model`` all-reduce (average) its gradients over ``group`` during backward, in place.

    Buffers are not broadcast each forward (every rank computes the same ones); a ``reduce_dtype``
    of bfloat16 sends the buckets in bfloat16, as FSDP's reduce dtype does.
    """
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel

    # torch 2.13 renamed broadcast_buffers (and warns about the old name); 2.11 has only the old one.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    replicate(model, process_group=group, gradient_as_bucket_view=True,
              **{"forward_sync_buffers" if renamed else "broadcast_buffers": False})
    if reduce_dtype == torch.bfloat16:
        model.register_comm_hook(group, _bfloat16_all_reduce)  # torch's bf16_compress_hook requires NCCL


def _bfloat16_all_reduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over ``group``, summed in bfloat16."""
    buffer = bucket.buffer()
    sent = buffer.div(group.size()).to(torch.bfloat16)

    def unpack(future: torch.futures.Future) -> torch.Tensor:  # the all-reduce is in place: ``sent`` holds the sum
        return buffer.copy_(sent)

    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(unpack)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward of ``model`` all-reduces (False: gradients accumulate locally, to be reduced
    with a later microbatch's). Models without ``apply_ddp`` are left alone."""
    from torch.distributed._composable.replicate import DDP

    if isinstance(model, DDP):
        model.set_requires_gradient_sync(enabled)


class PlainDDP(Technique):
    """Plain DDP (``ParallelDims.plain_ddp``): torch's reducer over the replicas."""

    name = "ddp"

    def __init__(self, group: dist.ProcessGroup, reduce_dtype: torch.dtype):
        self.group, self.reduce_dtype = group, reduce_dtype

    @classmethod
    def build(cls, setup: ChunkSetup) -> "PlainDDP | None":
        group = setup.meshes.ddp
        return None if group is None else cls(group, setup.reduce_dtype)

    def apply(self, chunk: nn.Module) -> None:
        apply_ddp(chunk, self.group, reduce_dtype=self.reduce_dtype)

    def gradient_sync(self, chunk: nn.Module, enabled: bool) -> None:
        set_gradient_sync(chunk, enabled)
