"""Automatic tensor-parallel plans for model families without a hand-written one.

The repeated block is run once on the meta device (no memory, no compute) and its autograd
graph tells which Linear layers feed which:
- an *entry* Linear reads only the block's input (through norms and element-wise ops): it
  starts a parallel region and is split by output columns (ColwiseParallel);
- an *exit* Linear reads only entries' outputs (through activations, reshapes, attention): it
  ends the region and is split by input rows (RowwiseParallel), whose all-reduce restores the
  full result;
- anything else (a chain three Linears deep, an entry whose output also reaches the residual
  stream, a fused projection that is split into several tensors afterwards) cannot be proven
  safe and stays replicated, with a warning naming it.
At the top level, an Embedding over the vocabulary becomes vocabulary-parallel and the final
Linear producing vocabulary logits is split by columns (with loss parallelism when enabled).
No sequence parallelism: which norms sit on the residual stream is not derived.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.models.registry import ModelLayout, model_blocks

if TYPE_CHECKING:  # DTensor is imported where it is used (a run without TP starts ~0.5 s sooner)
    from torch.distributed.tensor.parallel import ParallelStyle

logger = logging.getLogger(__name__)

# Autograd nodes that cut one tensor into several: a Linear behind one is a fused projection.
_SPLITS = ("SplitBackward", "SplitWithSizesBackward", "UnbindBackward", "ChunkBackward")


@dataclass
class TPPlan:
    """Styles for the top-level modules and for the modules of one block (applied to every block)."""

    top: dict[str, ParallelStyle] = field(default_factory=dict)
    block: dict[str, ParallelStyle] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)  # block Linear -> why it is not split
    derived: bool = True
    """Derived automatically (else the model family's hand-written plan)."""

    def describe(self) -> list[str]:
        lines = [f"  {name}: {type(style).__name__}" for name, style in {**self.top, **self.block}.items()]
        lines += [f"  {name}: replicated ({why})" for name, why in self.replicated.items()]
        return lines


def _walk(start, stop: dict, seen_split: bool = False) -> list[tuple[str, bool]]:
    """Linears (named in ``stop`` by their output's grad_fn) reachable backwards from ``start``,
    each with whether a split node lay on the way."""
    found, stack, visited = [], [(start, False)], set()
    while stack:
        node, split = stack.pop()
        if node is None or (node, split) in visited:
            continue
        visited.add((node, split))
        if node in stop and node is not start:
            found.append((stop[node], split))
            continue
        split = split or type(node).__name__.startswith(_SPLITS)
        stack.extend((n, split) for n, _ in node.next_functions)
    return found


def _block_graph(model: nn.Module, layers_attr: str, seq_len: int):
    """Run the model on meta tokens and record, in its first block, each Linear's input and output."""
    block = next(iter(model_blocks(model, layers_attr).values()))
    records: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    captured = {}

    def record(name: str):
        def hook(module, args, out) -> None:  # returns None: the forward is only observed
            if name:
                if args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
                    records[name] = (args[0], out)
            else:
                captured["out"] = out

        return hook

    hooks = [block.register_forward_hook(record(""))]
    for name, mod in block.named_modules():
        # Linears, and other modules with weights of their own (norms: one inside the parallel region
        # would see only its shard's features, and its weight's gradient would be partial)
        if isinstance(mod, nn.Linear) or (name and next(mod.parameters(recurse=False), None) is not None):
            hooks.append(mod.register_forward_hook(record(name)))
    try:
        with torch.enable_grad():
            model(torch.zeros(1, seq_len, dtype=torch.long, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    out = captured["out"]
    return block, records, out[0] if isinstance(out, tuple) else out


OVERRIDE_KEY = "[parallelism.tensor_parallel_overrides]"


def _apply_overrides(plan: TPPlan, overrides: dict, block: nn.Module, top_names: set[str]) -> None:
    """Replace derived styles: names are block-relative (``attention.wq``) or top-level (``output``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    for name, style in overrides.items():
        if style not in ("colwise", "rowwise", "replicate"):
            raise ConfigError(f"{OVERRIDE_KEY} {name}: got {style!r}, expected 'colwise', 'rowwise' or 'replicate'")
        target = plan.top if name in top_names else plan.block if name in linears else None
        if target is None:
            raise ConfigError(
                f"{OVERRIDE_KEY} {name}: not a Linear of the block nor a top-level module"
                f" (block Linears: {', '.join(sorted(linears))})"
            )
        target.pop(name, None)
        plan.replicated.pop(name, None)
        if style == "replicate":
            plan.replicated[name] = "set by tensor_parallel_overrides"
        else:
            target[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()


def derive_tp_plan(model: nn.Module, layout: ModelLayout, *, tp: int, seq_len: int, loss_parallel: bool,
                   overrides: dict | None = None) -> TPPlan:
    """A plan for ``model`` (whole, on the meta device), with ``overrides`` applied; raises ConfigError
    if a split Linear cannot be divided by ``tp``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = TPPlan()
    vocab, layers_attr, pre, post = layout.vocab_size, layout.blocks, layout.pre, layout.post
    for name in pre:
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Embedding) and mod.num_embeddings == vocab:
            plan.top[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name in post:
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Linear) and mod.out_features == vocab:
            plan.top[name] = ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )

    block, records, block_out = _block_graph(model, layers_attr, seq_len)
    # A module with weights that is never called (its weight read by its parent's code, e.g. attention sinks: one
    # logit per head) leaves no trace in the graph: whether it must be split with the heads cannot be derived.
    for name, mod in block.named_modules():
        if name and name not in records and next(mod.parameters(recurse=False), None) is not None:
            raise ConfigError(f"[parallelism] tensor_parallel_plan = \"auto\": {layers_attr}.N.{name} is read by its"
                              " parent's code, which the derived plan cannot tell how to split; set"
                              " tensor_parallel_plan = \"model\" (the family's plan)")
    weighted = {name: records.pop(name) for name in list(records)
                if not isinstance(block.get_submodule(name), nn.Linear)}
    producer = {out.grad_fn: name for name, (_, out) in records.items() if out.grad_fn is not None}
    deps = {name: _walk(inp.grad_fn, producer) for name, (inp, _) in records.items()}
    normed = {src: name for name, (inp, _) in weighted.items() for src, _ in _walk(inp.grad_fn, producer)}
    sources = {name: {src for src, _ in d} for name, d in deps.items()}
    to_residual = {n for n, _ in _walk(block_out.grad_fn, producer)}
    # In forward order: a Linear whose inputs are all whole (block input, or outputs of exits and
    # replicated Linears) is an entry; one whose inputs are all entries' outputs is an exit.
    role: dict[str, str] = {}
    for name in records:
        if all(role[s] in ("exit", "replicated") for s in sources[name]):
            role[name] = "entry"
        elif all(role[s] == "entry" for s in sources[name]) and not any(split for _, split in deps[name]):
            role[name] = "exit"
        else:
            role[name] = "replicated"
            fused = any(split for _, split in deps[name]) and all(role[s] == "entry" for s in sources[name])
            plan.replicated[name] = ("its input is a fused projection cut into pieces" if fused
                                     else "its input mixes sharded and whole tensors")
            for src in sources[name]:
                if role[src] == "entry" and fused:
                    role[src] = "replicated"
                    plan.replicated[src] = "fused projection (one output cut into several tensors)"
    # Fixpoint: an entry's output may only feed exits (a sharded tensor must not reach the
    # residual stream or another consumer), and an exit needs every input to be an entry's.
    changed = True
    while changed:
        changed = False
        for name in records:
            consumers = {c for c in records if name in sources[c]}
            bad = None
            if role[name] == "entry":
                if name in normed:
                    bad = f"its output goes through {normed[name]}, whose weight would see one shard only"
                elif name in to_residual:
                    bad = "its output reaches the residual stream directly"
                elif not consumers:
                    bad = "no linear layer consumes its output"
                elif any(role[c] != "exit" for c in consumers):
                    bad = "its output feeds a layer that is not split by rows"
            elif role[name] == "exit" and any(role[s] != "entry" for s in sources[name]):
                bad = "some of its inputs are not split"
            if bad:
                role[name], plan.replicated[name], changed = "replicated", bad, True
    for name in records:
        if role[name] == "entry":
            plan.block[name] = ColwiseParallel()
        elif role[name] == "exit":
            plan.block[name] = RowwiseParallel()
        else:
            plan.replicated.setdefault(name, "role not established")
    if overrides:
        _apply_overrides(plan, overrides, block, {n for n in pre + post if getattr(model, n, None) is not None})
    for name, style in plan.block.items():
        linear = block.get_submodule(name)
        size = linear.out_features if isinstance(style, ColwiseParallel) else linear.in_features
        if size % tp:
            side = "output" if isinstance(style, ColwiseParallel) else "input"
            raise ConfigError(
                f"[parallelism] tensor_parallel_plan=auto: {layers_attr}.*.{name} has {size} {side} features,"
                f" not divisible by tensor_parallel_degree={tp}"
            )
    for name, why in sorted(plan.replicated.items()):
        if not (overrides or {}).get(name):
            logger.warning("automatic TP: %s.*.%s stays replicated: %s", layers_attr, name, why)
    return plan
