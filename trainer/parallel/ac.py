"""Activation checkpointing per block: none, full, every N-th block, or a per-operator policy.

The block's ``forward`` is wrapped in ``torch.utils.checkpoint`` on the instance, so the
module tree and parameter names do not change (initialisation and checkpoints are keyed by
those names; wrapper modules would add a prefix). torch's composable ``checkpoint`` hook API
is not used because it re-enters a one-shot context when a zero-bubble schedule recomputes
for the input-gradient and again for the weight-gradient pass.
"""

import contextlib
import functools
from typing import Literal

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.models.registry import model_blocks
from trainer.parallel.technique import ChunkSetup, Technique

# Outputs worth keeping under per-op selective AC: the expensive matmuls and attention.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


# Profiler annotations are not computation: the collectives of expert parallelism enter them a different
# number of times in the recomputed forward, which per-op checkpointing would take for a changed forward.
# torch's own list of ops it does not track (sizes, strides, ...) takes them too.
_NOT_COMPUTATION = [getattr(torch.ops.profiler, name).default
                    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")]
_NOT_COMPUTATION.append(torch.ops.profiler._record_function_exit._RecordFunction)


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Under:
    """Enters the torch-function ``modes`` that are not active at that moment, then ``inner``. Reusable: a
    zero-bubble schedule recomputes a block twice (for the input-gradient and the weight-gradient pass)."""

    def __init__(self, modes: list, inner):
        self.modes, self.inner, self.stacks = modes, inner, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        active = _get_current_function_mode_stack()
        for mode in self.modes:
            if not any(m is mode for m in active):
                stack.enter_context(mode)
        stack.enter_context(self.inner)
        self.stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def _contexts(selective_ops: bool):
    """checkpoint's context_fn: the recomputation runs under the torch-function modes that were active when
    the forward ran. Autograd does not carry them into backward, and a mode that rewrites an op (context
    parallelism's attention) would otherwise be missing from the recomputed forward, which then saves other
    tensors than the original one."""
    modes = _get_current_function_mode_stack()
    forward, recompute = (create_selective_checkpoint_contexts(_op_policy) if selective_ops
                          else (contextlib.nullcontext(), contextlib.nullcontext()))
    return forward, _Under(modes, recompute)


def _checkpoint_forward(block: nn.Module, *, selective_ops: bool) -> None:
    inner = block.forward
    eager_fn = functools.partial(_contexts, selective_ops)
    # Inside a compiled block torch.compile takes only the selective-checkpoint pair of dispatch modes as a
    # context_fn, or none (anything else fails its compilation), and needs no re-entered torch-function modes: the
    # compiled graph already holds what they did at forward, and its backward recomputes from that graph.
    compiled = {}
    if selective_ops:
        compiled["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _op_policy)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        contexts = compiled if torch.compiler.is_compiling() else {"context_fn": eager_fn}
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **contexts, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, *, mode: Literal["none", "full", "selective"], option: str, layers_attr: str) -> None:
    """Checkpoint blocks in place. ``option`` (selective): 'op', or N = every N-th block."""
    if mode == "none":
        return
    if mode == "selective" and option == "op":
        from torch.utils import checkpoint as torch_checkpoint

        getattr(torch_checkpoint, "SAC_IGNORED_OPS", set()).update(_NOT_COMPUTATION)
    for name, block in model_blocks(model, layers_attr).items():
        if mode == "full" or (option != "op" and int(name) % int(option) == 0):
            _checkpoint_forward(block, selective_ops=False)
        elif option == "op":
            _checkpoint_forward(block, selective_ops=True)


class ActivationCheckpointing(Technique):
    """``[activation_checkpoint]``: blocks (all, every N-th, or per operator) recompute in backward."""

    name = "ac"

    def __init__(self, mode: Literal["full", "selective"], option: str, layers_attr: str):
        self.mode, self.option, self.layers_attr = mode, option, layers_attr

    @classmethod
    def build(cls, setup: ChunkSetup) -> "ActivationCheckpointing | None":
        ac = setup.activation_checkpoint
        return None if ac.mode == "none" else cls(ac.mode, ac.selective_ac_option, setup.layout.blocks)

    def apply(self, chunk: nn.Module) -> None:
        apply_ac(chunk, mode=self.mode, option=self.option, layers_attr=self.layers_attr)
