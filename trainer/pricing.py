"""What a pipeline split costs, before anything runs: each part's price for the split search (from the FLOP
model, or from a measured cost file, ``[parallelism] pipeline_parallel_cost_file``), and each pipeline rank's
memory for a split (state + activations + the loss's gradient), which the search holds to the memory limit and
the dry run prints. ``trainer.plan`` builds the plan from them."""

import os
from typing import Any

import torch
from torch import nn

from trainer.config import JobConfig
from trainer.dtypes import torch_dtype
from trainer.models import ModelSpec, model_blocks
from trainer.models.registry import ModelLayout
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline_cost import (PartCosts, calibrated_costs, flop_costs, memory_bytes, part_flops,
                                            read_cost_file)
from trainer.parallel.pipeline_split import PipelinePlan, module_costs, schedule_traits
from trainer.parallel.schedule_sim import schedule_ops


# fp32 parameter + fp32 gradient + two fp32 Adam moments.
BYTES_PER_PARAM = 16
LOSS_GRADIENT_BYTES = 8
"""Bytes a logit the loss's backward allocates at once: nll_loss's and log_softmax's float32 gradients."""


def compute_dtype(mixed_precision_param: str, device: str) -> torch.dtype:
    """``[training] mixed_precision_param``: auto = bfloat16 on accelerators, float32 on CPU."""
    if mixed_precision_param == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return torch_dtype(mixed_precision_param)


def split_memory_limit(parallelism, this_device: bool = True) -> float | None:
    """Bytes each pipeline rank may hold in the split search: ``pipeline_parallel_memory_limit_gib``, else (0) this
    machine's device memory (``this_device``; none for a dry run, which plans for other machines)."""
    return parallelism.pipeline_parallel_memory_limit_gib * 2**30 or (device_memory_bytes() if this_device else None)


def device_memory_bytes() -> int:
    """Memory of one device of this machine: the first accelerator's, or the machine's RAM."""
    from trainer.env import device_type

    if device_type() == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_limit(rank_bytes, limit: float):
    """``fits(counts, placement)`` for the split search: whether every rank of a split stays within ``limit``."""
    return lambda counts, placement: max(rank_bytes(counts, placement)) <= limit


def cost_identity(config: JobConfig, n_blocks: int, tp: int, cp: int) -> dict:
    """What a measured pipeline cost file must share with the job it plans (pipeline_cost.IDENTITY_KEYS)."""
    m = config.model
    return {"model": f"{m.name} {m.flavor} {dict(sorted(m.overrides.items()))}",
            "n_layers": n_blocks, "seq_len": config.training.seq_len,
            "microbatch_size": config.parallelism.pipeline_parallel_microbatch_size, "tp": tp, "cp": cp,
            "activation_checkpoint": (f"{config.activation_checkpoint.mode}"
                                      f" {config.activation_checkpoint.selective_ac_option}"),
            "dtype": config.training.mixed_precision_param,
            "attention": m.attn_mask_type + (f" {m.attn_backend}" if m.attn_backend != "sdpa" else "")}


def pipeline_costs(config: JobConfig, spec: ModelSpec, args: Any, whole: nn.Module, dims: ParallelDims,
                   device: str, *, relative: bool = False) -> PartCosts:
    """The planner's per-part costs: measured ones from ``pipeline_parallel_cost_file``, else the FLOP model
    (``relative``: always the FLOP model in relative units, what measurements are fitted against)."""
    p, t, ac = config.parallelism, config.training, config.activation_checkpoint
    tokens = p.pipeline_parallel_microbatch_size * t.seq_len // dims.cp
    dtype = compute_dtype(t.mixed_precision_param, device)
    layout = spec.layout(args)
    send_bytes = tokens * (layout.dim or 0) * dtype.itemsize
    n_blocks = len(model_blocks(whole, spec.layers_attr))
    recompute = [ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op"
                                        and i % int(ac.selective_ac_option) == 0) for i in range(n_blocks)]
    flops = part_flops(whole, layout, seq_len=t.seq_len)
    link = dict(send_bytes=send_bytes, link_bytes_per_second=p.pipeline_parallel_link_gbytes_per_second * 1e9,
                link_latency=p.pipeline_parallel_link_latency_us * 1e-6)
    units = flop_costs(flops, tokens=tokens, tp=dims.tp, recompute=recompute, flops_per_second=None, **link)
    if relative:
        return units
    if not p.pipeline_parallel_cost_file:
        memory = memory_bytes(whole, layout, tokens=tokens, tp=dims.tp, dtype_bytes=dtype.itemsize,
                              loss_sharded=dims.tp > 1 and not p.disable_loss_parallel) if (
            p.pipeline_parallel_device_memory_gbytes_per_second) else None
        return flop_costs(flops, tokens=tokens, tp=dims.tp, recompute=recompute,
                          flops_per_second=p.pipeline_parallel_device_tflops * 1e12 or None, memory=memory,
                          memory_bytes_per_second=p.pipeline_parallel_device_memory_gbytes_per_second * 1e9, **link)
    identity = cost_identity(config, n_blocks, dims.tp, dims.cp)
    measured = read_cost_file(p.pipeline_parallel_cost_file, identity)
    where = measured["measured"]
    send = where.get("transfer_s", link["link_latency"] + send_bytes / link["link_bytes_per_second"])
    counts = where.get("counts")
    how = (f"{where['method']} ({where.get('device')}); transfers priced by the link settings" if "method" in where
           else f"{where.get('schedule')} on {where.get('device')}, split {where.get('split_points')}")
    return calibrated_costs(units, measured["fit"], send=send, measured_counts=tuple(counts) if counts else None,
                            source=f"measured ({p.pipeline_parallel_cost_file}: {how})")


def loss_gradient_bytes(config: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims, sequences: int) -> float:
    """``JobPlan.loss_gradient_bytes`` for a microbatch of ``sequences``: 8 bytes a logit of the rank's tokens, the
    vocabulary split over tp under loss parallelism."""
    vocab = spec.vocab_size(args)
    if dims.tp > 1 and not config.parallelism.disable_loss_parallel:
        vocab /= dims.tp
    return LOSS_GRADIENT_BYTES * sequences * (config.training.seq_len // dims.cp) * vocab


def activation_sections(config: JobConfig) -> dict:
    """What the activation estimate (trainer.activation_memory.part_activations) reads of the config."""
    return dict(activation_checkpoint=config.activation_checkpoint, parallelism=config.parallelism,
                seq_len=config.training.seq_len, attn_mask_type=config.model.attn_mask_type,
                attn_backend=config.model.attn_backend)


def split_memory(config: JobConfig, spec: ModelSpec, args: Any, whole: nn.Module, dims: ParallelDims, device: str,
                 n_micro: int):
    """``rank_bytes(counts, placement)``: each pipeline rank's state + activation bytes for stages of ``counts``
    blocks, rank r holding stages ``placement[r]`` (activations 0 where they are not estimated), plus the loss's
    gradient on the rank holding the last stage: the dry run's memory table, per rank."""
    from trainer.activation_memory import part_activations, rank_actions, rank_peaks

    p = config.parallelism
    present = lambda names: [getattr(whole, n) for n in names if getattr(whole, n, None) is not None]  # noqa: E731
    params = [sum(x.numel() for m in present(spec.pre_layers) for x in m.parameters()),
              *(sum(x.numel() for x in b.parameters()) for b in model_blocks(whole, spec.layers_attr).values()),
              sum(x.numel() for m in present(spec.post_layers) for x in m.parameters())]
    split = dims.dp_shard * dims.cp * dims.tp
    per_part = part_activations(spec, args, dims, compute_dtype(config.training.mixed_precision_param, device).itemsize,
                                **activation_sections(config))
    schedule, traits = schedule_traits(p)
    tokens = p.pipeline_parallel_microbatch_size * config.training.seq_len
    walked = []  # each rank's actions, walked once for every split priced
    loss = loss_gradient_bytes(config, spec, args, dims, p.pipeline_parallel_microbatch_size)

    def rank_bytes(counts: tuple[int, ...], placement: list[list[int]]) -> list[float]:
        last = len(counts) - 1
        stage_state, start = [], 1
        for s, c in enumerate(counts):
            stage_state.append(sum(params[start:start + c]) + (params[0] if s == 0 else 0)
                               + (params[-1] if s == last else 0))
            start += c
        acts = [0.0] * dims.pp
        if not traits.from_file and not isinstance(per_part, str):
            if not walked:
                walked.extend(rank_actions(schedule_ops(schedule, dims.pp, n_micro, len(counts) // dims.pp)))
            acts = rank_peaks(per_part, counts, walked, tokens)
        return [sum(stage_state[s] for s in placement[r]) * BYTES_PER_PARAM / split + acts[r]
                + (loss if last in placement[r] else 0.0) for r in range(dims.pp)]

    return rank_bytes


def stage_costs(whole: nn.Module, layout: ModelLayout, pipeline: PipelinePlan | None,
                 seq_len: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Parameters and forward FLOPs/token per stage, from the whole model's modules (no chunk is built).

    A tied weight counts on both the first and the last stage: each holds a copy."""
    def params(modules: list[nn.Module]) -> int:
        return sum(x.numel() for m in modules for x in m.parameters())

    pre = [getattr(whole, n) for n in layout.pre if getattr(whole, n, None) is not None]
    post = [getattr(whole, n) for n in layout.post if getattr(whole, n, None) is not None]
    blocks = model_blocks(whole, layout.blocks)
    pre_f, block_f, post_f = module_costs(whole, layout, mode="flops", seq_len=seq_len)
    if pipeline is None:
        return (sum(x.numel() for x in whole.parameters()),), (pre_f + sum(block_f) + post_f,)
    index = {key: i for i, key in enumerate(blocks.keys())}
    counts, flops = [], []
    for stage in pipeline.stages:
        mods = [blocks[k] for k in stage.blocks] + (pre if stage.first else []) + (post if stage.last else [])
        counts.append(params(mods))
        flops.append(sum(block_f[index[k]] for k in stage.blocks) + (pre_f if stage.first else 0.0)
                     + (post_f if stage.last else 0.0))
    return tuple(counts), tuple(flops)
