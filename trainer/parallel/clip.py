"""Gradient clipping by the true global norm."""

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most ``max_norm`` (0 = never); return the norm.

    DTensor gradients (FSDP / TP shards) reduce over their mesh when the norm is materialised,
    so the returned norm is that of the whole unsharded model.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=True)
    return total
