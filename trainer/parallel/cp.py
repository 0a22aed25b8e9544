"""Context parallelism: each sequence is split over the cp ranks along the sequence dimension.

Load balancing: the sequence is cut into 2C chunks and cp rank i holds chunks i and 2C-1-i, so
every rank gets the same share of the causal attention work (an early and a late chunk).

Attention: keys and values are all-gathered over the cp group (as Llama 3 was trained at long
context) and each rank's queries attend to the sequence up to their own positions, one
contiguous run (chunk) at a time. The gather is autograd-aware: its backward reduce-scatters the
key/value gradients back to the ranks that own them. With grouped-query attention only the kv heads
are gathered. This runs on any backend and device, gloo on CPU included (torch's experimental
``context_parallel`` has no sharding rule for the CPU attention kernel).

Documents (block-causal attention): a family that takes ``positions`` (each token's position within
its document) gets them sharded like its tokens, rotates its tokens by them and builds its mask with
trainer.models.attention.block_causal_mask; while a step runs, this technique's ``SequenceLayout``
makes that mask one of the rank's queries against every key of the sequence (in global order), so a
query sees exactly the keys of its own document up to itself, wherever they are held. Such a family
gets positions under causal attention too (0, 1, ... of the whole window).

The model stays unaware of all this: ``ContextParallelAttention`` is a ``TorchFunctionMode`` that,
while a step runs, replaces each ``F.scaled_dot_product_attention`` call (causal, or with such a
mask) with the gathered one. A family without ``positions`` declares its position-indexed buffers
(``ModelSpec.cp_buffers``, e.g. a rotary table), which ``apply_cp`` re-indexes to the rank's global
positions once; it runs causal attention only.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from trainer.errors import ConfigError, UserError
from trainer.models.attention import SequenceLayout
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
    """Within this mode, scaled-dot-product attention over local queries sees the whole sequence: causal, or
    under a mask of the local queries against every key (``block_causal_mask`` under a ``SequenceLayout``, which
    this mode enters with itself)."""

    def __init__(self, group: dist.ProcessGroup, positions: torch.Tensor, all_positions: torch.Tensor):
        """``positions``: this rank's global positions; ``all_positions``: every cp rank's, in rank order
        (the order in which the all-gather concatenates keys and values)."""
        super().__init__()
        self.group = group
        self.keys = len(all_positions)
        self.layout = SequenceLayout(positions, self.keys)
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

    def __enter__(self):
        self.layout.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.layout.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]  # (batch, heads, local seq, head_dim)
        mask = kwargs.get("attn_mask")
        if len(args) > 3 or (mask is None) != bool(kwargs.get("is_causal", False)) or (
                mask is not None and mask.shape[-1] != self.keys):
            raise UserError(
                "[parallelism] context_parallel_degree: the model calls F.scaled_dot_product_attention with a mask"
                " of its own or without is_causal=True; context parallelism supports causal attention and masks"
                " built by trainer.models.attention.block_causal_mask")
        self.calls += 1
        order = self.order.to(q.device)
        k = _all_gather(k.contiguous(), gather_dim=2, group=self.group).index_select(2, order)
        v = _all_gather(v.contiguous(), gather_dim=2, group=self.group).index_select(2, order)
        kwargs["is_causal"] = False
        outs = []
        for i, (a, b, prefix, _) in enumerate(self.runs):
            # no query of the run sees a key past its own position: the keys beyond the prefix are left out
            kwargs["attn_mask"] = self._mask(i, q) if mask is None else mask[:, :, a:b, :prefix]
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
        key = f"[parallelism] context_parallel_degree={cp}"
        if not facts.spec.positions and not facts.spec.cp_buffers:
            raise ConfigError(
                f"{key}: model family {facts.spec.name} takes no positions (ModelSpec.positions) and declares no"
                " position-indexed buffers (ModelSpec.cp_buffers), so it cannot be split along the sequence")
        if facts.compile_enabled:
            raise ConfigError(f"[compile] enable with {key}: not supported (a compiled block calls the attention kernel"
                              " directly, past the mode that gives each rank's queries the whole sequence's keys);"
                              " set [compile] enable = false")
        if facts.model.attn_backend == "varlen":
            raise ConfigError(f'[model] attn_backend = "varlen" with {key}: not supported (it attends each document'
                              " of a rank's contiguous tokens, and a rank holds two chunks of each sequence); use"
                              ' attn_backend = "sdpa"')

    @classmethod
    def build(cls, setup: ChunkSetup) -> "ContextParallel | None":
        meshes = setup.meshes
        if meshes.cp is None:
            return None
        # A family that takes positions is given them (sharded): its rotary table stays as it is.
        buffers = () if setup.spec.positions else setup.spec.cp_buffers
        return cls(meshes.cp.get_group(), meshes.dims.cp, meshes.world.get_local_rank("cp"), setup.seq_len, buffers)

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
