"""Activation memory in the plan: the peak of what autograd keeps for backward, per pipeline rank.

The family says what one token costs in each part of the model (``ModelSpec.activation_bytes``, in
the compute dtype, with TP/SP/loss-parallel splits). This module multiplies by the tokens of a
microbatch and counts how many microbatches each stage holds at once:

- without pipelining, one microbatch (gradient accumulation runs them one after another);
- with pipelining, it walks each rank's action list of the schedule (the same lists torch runs,
  trainer.parallel.schedule_sim): a forward adds the stage's microbatch, the backward that ends
  it frees it: B, or W for schedules that split the backward (the input-gradient pass I keeps the
  graph for W). The peak of the running sum is the rank's estimate.

Activation checkpointing: a checkpointed block keeps only its input, and while one block is
recomputed in backward its whole activations are alive once more (added once per rank).

Not estimated (the reason is shown instead): families without ``activation_bytes``, context
parallelism (the gathered keys/values and masked attention are not modelled), per-op selective
checkpointing, and custom CSV schedules.
"""

import torch

from trainer.parallel.schedule_sim import _flatten, schedule_ops


def activation_peaks(plan, device_type: str) -> list[float] | str:
    """Estimated peak bytes of saved activations on each pipeline rank when the job runs on ``device_type``
    devices (the compute dtype follows ``[training] mixed_precision_param``), or why there is no estimate."""
    config, spec, dims = plan.config, plan.spec, plan.dims
    if spec.activation_bytes is None:
        return f"model family {spec.name} does not declare ModelSpec.activation_bytes"
    if dims.cp > 1:
        return "not modelled under context parallelism"
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return "not modelled for per-op selective checkpointing"
    pipeline = plan.pipeline
    if pipeline is not None and pipeline.schedule == "csv":
        return "not modelled for CSV schedules"
    p = config.parallelism
    tp = dims.tp
    per_token = spec.activation_bytes(
        plan.model_args, dtype_bytes=plan.compute_dtype(torch.device(device_type)).itemsize, tp=tp,
        sequence_parallel=tp > 1 and p.enable_sequence_parallel and p.tensor_parallel_plan != "auto",
        loss_parallel=tp > 1 and not p.disable_loss_parallel)
    if isinstance(per_token, str):  # the family does not model these settings
        return per_token
    blocks = list(per_token.blocks)
    checkpointed = [_checkpointed(i, ac.mode, ac.selective_ac_option) for i in range(len(blocks))]
    kept = [per_token.block_input if c else a for a, c in zip(blocks, checkpointed, strict=True)]
    recompute = max([a - per_token.block_input for a, c in zip(blocks, checkpointed, strict=True) if c], default=0.0)
    seq = config.training.seq_len
    if pipeline is None:
        tokens = config.training.local_batch_size * seq
        return [tokens * (per_token.pre + sum(kept) + per_token.post + recompute)]
    tokens = p.pipeline_parallel_microbatch_size * seq
    index = {key: i for i, key in enumerate(k for stage in pipeline.stages for k in stage.blocks)}
    stage_bytes = [tokens * (sum(kept[index[k]] for k in stage.blocks) + (per_token.pre if stage.first else 0.0)
                             + (per_token.post if stage.last else 0.0)) for stage in pipeline.stages]
    stage_recompute = [tokens * max([blocks[index[k]] - per_token.block_input for k in stage.blocks
                                     if checkpointed[index[k]]], default=0.0) for stage in pipeline.stages]
    ops = schedule_ops(pipeline.schedule, pipeline.pp, plan.n_microbatches, pipeline.stages_per_rank)
    peaks = []
    for rank, actions in enumerate(ops):
        split = {(s, m) for a in actions for kind, s, m in _flatten(a) if kind == "W"}
        live = peak = 0.0
        for action in actions:
            for kind, stage, mb in _flatten(action):
                if kind == "F":
                    live += stage_bytes[stage]
                    peak = max(peak, live)
                elif kind == "B" or kind == "W" or (kind == "I" and (stage, mb) not in split):
                    live -= stage_bytes[stage]
        peaks.append(peak + max(stage_recompute[s] for s in pipeline.stage_ids(rank)))
    return peaks


def _checkpointed(index: int, mode: str, option: str) -> bool:
    if mode == "full":
        return True
    if mode == "selective":  # every option-th block (trainer.parallel.ac)
        return index % int(option) == 0
    return False
