"""Activation checkpointing per block: none, full, every N-th block, or a per-operator policy.

Uses the composable checkpoint API, which works through forward hooks and so leaves
parameter names unchanged (initialisation and checkpoints are keyed by those names).
"""

from typing import Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Outputs worth keeping under per-op selective AC: the expensive matmuls and attention.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, *, mode: Literal["none", "full", "selective"], option: str, layers_attr: str) -> None:
    """Checkpoint blocks in place. ``option`` (selective): 'op', or N = every N-th block."""
    if mode == "none":
        return
    for name, block in getattr(model, layers_attr).items():
        if mode == "full":
            checkpoint(block)
        elif option == "op":
            checkpoint(block, context_fn=lambda: create_selective_checkpoint_contexts(_op_policy))
        elif int(name) % int(option) == 0:
            checkpoint(block)
