"""Activation checkpointing per block: none, full, every N-th block, or a per-operator policy.

The block's ``forward`` is wrapped in ``torch.utils.checkpoint`` on the instance, so the
module tree and parameter names do not change (initialisation and checkpoints are keyed by
those names; wrapper modules would add a prefix). torch's composable ``checkpoint`` hook API
is not used because it re-enters a one-shot context when a zero-bubble schedule recomputes
for the input-gradient and again for the weight-gradient pass.
"""

import functools
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.models.registry import model_blocks

# Outputs worth keeping under per-op selective AC: the expensive matmuls and attention.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_forward(block: nn.Module, *, selective_ops: bool) -> None:
    inner = block.forward
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _op_policy)} if selective_ops else {}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, *, mode: Literal["none", "full", "selective"], option: str, layers_attr: str) -> None:
    """Checkpoint blocks in place. ``option`` (selective): 'op', or N = every N-th block."""
    if mode == "none":
        return
    for name, block in model_blocks(model, layers_attr).items():
        if mode == "full" or (option != "op" and int(name) % int(option) == 0):
            _checkpoint_forward(block, selective_ops=False)
        elif option == "op":
            _checkpoint_forward(block, selective_ops=True)
