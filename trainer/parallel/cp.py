"""Context parallelism: each sequence is split over the cp ranks along the sequence dimension.

Load balancing: the sequence is cut into 2C chunks and cp rank i holds chunks i and 2C-1-i, so
every rank gets the same share of the causal attention work (an early and a late chunk).

Attention: keys and values are all-gathered over the cp group (as Llama 3 was trained at long
context) and each rank's queries attend to the sequence up to their own positions, one
contiguous run (chunk) at a time, under a causal mask built from global positions. The gather is
autograd-aware: its backward reduce-scatters the key/value
gradients back to the ranks that own them. With grouped-query attention only the kv heads are
gathered. This runs on any backend and device, gloo on CPU included (torch's experimental
``context_parallel`` has no sharding rule for the CPU attention kernel).

The model stays unaware of all this: ``apply_cp`` re-indexes the family's position-indexed
buffers (the rotary table) to the rank's global positions once, and ``ContextParallelAttention``
is a ``TorchFunctionMode`` that, while a step runs, replaces each causal
``F.scaled_dot_product_attention`` call with the gathered, masked one.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from trainer.errors import ConfigError, UserError
from trainer.parallel.technique import ChunkSetup, PlanFacts, Technique


def _all_gather(tensor: torch.Tensor, *, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The autograd-aware all-gather (imported here: a job without CP does not load the functional collectives).
    torch 2.13 renamed it (the old name warns); 2.11 has only the old one."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor, gather_dim=gather_dim, group=group)


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp ``rank``: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of ``x`` (batch, seq, ...): the columns at ``positions``."""
    return x[:, positions.to(x.device)]


@torch.no_grad()
def apply_cp(model: nn.Module, positions: torch.Tensor, buffers: tuple[str, ...]) -> None:
    """Re-index the position-indexed ``buffers`` (e.g. the rotary table, (max_seq_len, ...)) so that
    row j holds global position ``positions[j]``: the model then rotates its local tokens by their
    global positions without knowing it is sharded. Call after the weights are materialised."""
    for name in buffers:
        table = getattr(model, name)
        setattr(model, name, table[positions.to(table.device)].clone())


class ContextParallelAttention(TorchFunctionMode):
    """Within this mode, causal scaled-dot-product attention over local queries sees the whole sequence."""

    def __init__(self, group: dist.ProcessGroup, positions: torch.Tensor, all_positions: torch.Tensor):
        """``positions``: this rank's global positions; ``all_positions``: every cp rank's, in rank order
        (the order in which the all-gather concatenates keys and values)."""
        super().__init__()
        self.group = group
        self.order = torch.argsort(all_positions)  # gathered keys -> global order
        # Each contiguous run of local queries attends only to the keys up to its last position (a
        # prefix): the early chunk skips the late half of the sequence instead of masking it.
        # (local start, local end, key prefix length, causal mask of the run over that prefix)
        self.runs = []
        starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
        for a, b in zip(starts, starts[1:] + [len(positions)]):
            run = positions[a:b]
            prefix = int(run[-1]) + 1
            self.runs.append((a, b, prefix, run[:, None] >= torch.arange(prefix)[None, :]))
        self._masks: dict = {}
        self.calls = 0
        """Attention calls rewritten so far: 0 after a forward means the model bypassed
        F.scaled_dot_product_attention."""

    def _mask(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Run ``i``'s mask as an additive float mask in ``like``'s dtype, made once and shared by every
        layer: the attention kernel keeps its mask for backward, and a bool mask would be converted
        (and kept) anew by each layer."""
        key = (i, like.device, like.dtype)
        if key not in self._masks:
            allowed = self.runs[i][3].to(like.device)
            self._masks[key] = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._masks[key]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]  # (batch, heads, local seq, head_dim)
        if len(args) > 3 or kwargs.get("attn_mask") is not None or not kwargs.get("is_causal", False):
            raise UserError(
                "[parallelism] context_parallel_degree: the model calls F.scaled_dot_product_attention with a mask or"
                " without is_causal=True; context parallelism supports causal attention without an explicit mask"
            )
        self.calls += 1
        order = self.order.to(q.device)
        k = _all_gather(k.contiguous(), gather_dim=2, group=self.group).index_select(2, order)
        v = _all_gather(v.contiguous(), gather_dim=2, group=self.group).index_select(2, order)
        kwargs["is_causal"] = False
        outs = []
        for i, (a, b, prefix, _) in enumerate(self.runs):
            kwargs["attn_mask"] = self._mask(i, q)
            outs.append(func(q[:, :, a:b], k[:, :, :prefix], v[:, :, :prefix], **kwargs))
        return torch.cat(outs, dim=2)


class ContextParallel(Technique):
    """``[parallelism] context_parallel_degree``: this rank's part of every sequence, the family's
    position-indexed buffers re-indexed to it, and the attention mode that lets it see the whole."""

    name = "cp"

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int, seq_len: int, buffers: tuple[str, ...] = ()):
        self.buffers = buffers
        self.positions = load_balanced_positions(seq_len, cp, rank)
        self.all_positions = torch.cat([load_balanced_positions(seq_len, cp, r) for r in range(cp)])
        self._attention = ContextParallelAttention(group, self.positions, self.all_positions)

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        cp = facts.dims.cp
        if cp == 1:
            return
        if not facts.spec.cp_buffers:
            raise ConfigError(
                f"[parallelism] context_parallel_degree={cp}: model family {facts.spec.name} does not declare"
                " its position-indexed buffers (ModelSpec.cp_buffers), so it cannot be split along the sequence")
        if facts.model.attn_mask_type == "block_causal":
            raise ConfigError(
                f'[model] attn_mask_type = "block_causal" with [parallelism] context_parallel_degree={cp}: not'
                " supported yet (context parallelism's gathered attention masks by position, not by document);"
                ' set [model] attn_mask_type = "causal"')

    @classmethod
    def build(cls, setup: ChunkSetup) -> "ContextParallel | None":
        meshes = setup.meshes
        if meshes.cp is None:
            return None
        return cls(meshes.cp.get_group(), meshes.dims.cp, meshes.world.get_local_rank("cp"), setup.seq_len,
                   setup.spec.cp_buffers)

    def after_materialize(self, chunk: nn.Module) -> None:  # init computes the rotary table for local positions
        apply_cp(chunk, self.positions, self.buffers)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, self.positions)

    def step_context(self) -> ContextParallelAttention:
        """The mode entered around each forward and backward (one instance: its masks are reused)."""
        return self._attention

    def after_first_step(self) -> None:
        if self._attention.calls == 0:
            raise UserError(  # every rank of the job runs the same model: all stop here
                "[parallelism] context_parallel_degree: the model's attention does not call"
                " F.scaled_dot_product_attention, so its context-parallel ranks would not see each other's tokens")
