"""Activation memory in the plan: the peak of what autograd keeps for backward, per pipeline rank.

The family says what one token costs in each part of the model (``ModelSpec.activation_bytes``, in
the compute dtype, with TP/SP/loss-parallel splits). This module multiplies by the tokens of a
microbatch and counts how many microbatches each stage holds at once:

- without pipelining, one microbatch (gradient accumulation runs them one after another);
- with pipelining, it walks each rank's action list of the schedule (the same lists torch runs,
  trainer.pipeline.simulate): a forward adds the stage's microbatch, the backward that ends
  it frees it: B, or W for schedules that split the backward (the input-gradient pass I keeps the
  graph for W). The peak of the running sum is the rank's estimate.

Activation checkpointing: a checkpointed block keeps only its input, and while one block is
recomputed in backward its whole activations are alive once more (added once per rank).

Not estimated (the reason is shown instead): families without ``activation_bytes``, context
parallelism (the gathered keys/values and masked attention are not modelled), per-op selective
checkpointing, and custom CSV schedules.
"""

from dataclasses import dataclass

from trainer.config import JobConfig


@dataclass(frozen=True)
class PartActivations:
    """Bytes per token each part (pre, block 0 .. n-1, post) keeps for backward, and what recomputing
    it under activation checkpointing holds at once (0 for parts not checkpointed)."""

    kept: tuple[float, ...]
    recompute: tuple[float, ...]
    stage: float = 0.0
    """What every pipeline stage keeps once per microbatch besides its parts (the document mask)."""


def part_activations(spec, args, dims, dtype_bytes: int, *, activation_checkpoint, parallelism, seq_len: int,
                     attn_mask_type: str, attn_backend: str = "sdpa") -> PartActivations | str:
    """Per-token activation bytes of each part, or why there is no estimate. ``spec``, ``args``, ``dims``: the
    plan's family, its args and the parallel degrees; ``activation_checkpoint`` and ``parallelism`` are those
    config sections, ``attn_mask_type`` and ``attn_backend`` those keys of ``[model]``."""
    if spec.activation_bytes is None:
        return f"model family {spec.name} does not declare ModelSpec.activation_bytes"
    if dims.cp > 1:
        return "not modelled under context parallelism"
    ac = activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return "not modelled for per-op selective checkpointing"
    p, tp = parallelism, dims.tp
    per_token = spec.activation_bytes(
        args, dtype_bytes=dtype_bytes, tp=tp,
        sequence_parallel=tp > 1 and p.enable_sequence_parallel and p.tensor_parallel_plan != "auto",
        loss_parallel=tp > 1 and not p.disable_loss_parallel)
    if isinstance(per_token, str):  # the family does not model these settings
        return per_token
    blocks = list(per_token.blocks)
    checkpointed = [_checkpointed(i, ac.mode, ac.selective_ac_option) for i in range(len(blocks))]
    kept = [per_token.block_input if c else a for a, c in zip(blocks, checkpointed, strict=True)]
    recompute = [a - per_token.block_input if c else 0.0 for a, c in zip(blocks, checkpointed, strict=True)]
    # Block-causal attention: each stage builds one additive mask (seq_len values per token, in the compute
    # dtype; none under the varlen backend) and the per-token rotary table, shared by its blocks (kept in full
    # where a window holds a boundary).
    mask = seq_len * dtype_bytes if attn_backend != "varlen" else 0.0
    stage = mask + per_token.documents if attn_mask_type == "block_causal" else 0.0
    return PartActivations((per_token.pre, *kept, per_token.post), (0.0, *recompute, 0.0), stage)


def activation_sections(config: JobConfig) -> dict:
    """What the activation estimate (``part_activations``) reads of the config."""
    return dict(activation_checkpoint=config.activation_checkpoint, parallelism=config.parallelism,
                seq_len=config.training.seq_len, attn_mask_type=config.model.attn_mask_type,
                attn_backend=config.model.attn_backend)


def rank_actions(queues: list[list[tuple[str, int, int]]]) -> list[tuple[list, set]]:
    """Each rank's (kind, stage, microbatch) actions in order (``trainer.pipeline.simulate.lowered``), and the
    (stage, microbatch) pairs whose backward is split (their W frees the activations): what ``rank_peaks`` walks."""
    return [(flat, {(s, m) for kind, s, m in flat if kind == "W"}) for flat in queues]


def rank_peaks(per_part: PartActivations, counts: list[int] | tuple[int, ...], walked: list[tuple[list, set]],
               tokens: int) -> list[float]:
    """Peak saved bytes of each pipeline rank for stages of ``counts`` blocks, walking each rank's
    schedule actions (``rank_actions`` of torch's lists, made once for any number of splits) with
    microbatches of ``tokens`` tokens."""
    last = len(counts) - 1
    stage_bytes, stage_recompute, start = [], [], 1
    for s, c in enumerate(counts):
        parts = (list(range(start, start + c)) + ([0] if s == 0 else [])
                 + ([len(per_part.kept) - 1] if s == last else []))
        stage_bytes.append(tokens * (sum(per_part.kept[i] for i in parts) + per_part.stage))
        stage_recompute.append(tokens * max(per_part.recompute[i] for i in parts))
        start += c
    peaks = []
    for flat, split in walked:
        live = peak = 0.0
        for kind, stage, mb in flat:
            if kind == "F":
                live += stage_bytes[stage]
                peak = max(peak, live)
            elif kind == "B" or kind == "W" or (kind == "I" and (stage, mb) not in split):
                live -= stage_bytes[stage]
        peaks.append(peak + max(stage_recompute[s] for s in {s for _, s, _ in flat}))
    return peaks


def _checkpointed(index: int, mode: str, option: str) -> bool:
    if mode == "full":
        return True
    if mode == "selective":  # every option-th block (trainer.parallel.ac)
        return index % int(option) == 0
    return False
