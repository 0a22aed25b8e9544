"""What each pipeline action (F, B, I, W) costs on every part of the model before anything runs, from the FLOP
model or a measured cost file, and each pipeline rank's memory for a split (docs/pipeline.md, "The planner")."""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from trainer.config import JobConfig
from trainer.config.schedules import schedule_traits
from trainer.config.schema import Parallelism
from trainer.dtypes import compute_dtype
from trainer.env import device_memory_bytes
from trainer.errors import ConfigError, UserError
from trainer.jsonfile import entry, read_json
from trainer.models import ModelSpec
from trainer.models.registry import ModelLayout, model_blocks
from trainer.parallel.dims import ParallelDims
from trainer.pipeline.simulate import KINDS, lowered, schedule_ops

# fp32 parameter + fp32 gradient + two fp32 Adam moments.
BYTES_PER_PARAM = 16
LOSS_GRADIENT_BYTES = 8
"""Bytes a logit the loss's backward allocates at once: nll_loss's and log_softmax's float32 gradients."""
COST_FILE_KEY = "[parallelism] pipeline_parallel_cost_file"


@dataclass(frozen=True)
class PartCosts:
    """Cost of one microbatch through each part (pre, block 0 .. n-1, post) per action kind."""

    parts: dict[str, tuple[float, ...]]
    """Kind (F, B, I, W) -> cost of each part: index 0 = pre, 1..n = blocks, n + 1 = post."""
    overhead: dict[str, float]
    """Kind -> fixed cost of every action of that kind, whatever its stage holds."""
    send: float
    """One activation or gradient transfer between two pipeline ranks (0: not modelled)."""
    unit: str
    """"s" (seconds) or "units" (1 = the mean block's forward of one microbatch)."""
    source: str
    """Where the numbers come from, for the dry run."""
    measured_counts: tuple[int, ...] | None = None
    """Blocks per stage of the run the costs were measured on (measured costs only)."""

    @property
    def num_blocks(self) -> int:
        return len(self.parts["F"]) - 2

    def stage_table(self, counts: list[int] | tuple[int, ...]) -> list[list[float]]:
        """``table[kind index][stage]`` (kinds in KINDS order) for stages of ``counts`` blocks each."""
        table = [stage_sums(self.parts[kind], counts, self.overhead[kind]) for kind in KINDS]
        # torch's split backward runs the first stage's whole backward as its W (its inputs are token ids)
        i, w, b = KINDS.index("I"), KINDS.index("W"), KINDS.index("B")
        table[w][0] = table[b][0]
        table[i][0] = 0.0
        return table


def stage_sums(parts, counts, base: float = 0.0) -> list[float]:
    """Each stage's ``base`` + sum of ``parts`` (pre, each block, post) for stages of ``counts`` blocks: pre on the
    first stage, post on the last."""
    out, start, last = [], 1, len(counts) - 1
    for s, c in enumerate(counts):
        out.append(base + math.fsum(parts[start:start + c]) + (parts[0] if s == 0 else 0.0)
                   + (parts[-1] if s == last else 0.0))
        start += c
    return out


def model_parts(model: nn.Module, layout: ModelLayout) -> list[list[nn.Module]]:
    """The modules of each part: those before the blocks present in ``model``, each block, those after."""
    def present(names: tuple[str, ...]) -> list[nn.Module]:
        return [getattr(model, n) for n in names if getattr(model, n, None) is not None]

    return [present(layout.pre), *([b] for b in model_blocks(model, layout.blocks).values()), present(layout.post)]


def part_params(model: nn.Module, layout: ModelLayout) -> list[int]:
    """Parameters of each part (pre, each block, post); a weight tied between pre and post counts in both."""
    return [sum(x.numel() for m in modules for x in m.parameters()) for modules in model_parts(model, layout)]


def part_flops(model: nn.Module, layout: ModelLayout, *, seq_len: int) -> list[tuple[float, float]]:
    """(matmul FLOPs, attention-score FLOPs) of one token's forward through each part: pre, each block, post
    (docs/pipeline.md, "Cost of each action"; modules may report theirs with ``forward_flops_per_token()``)."""
    parts = model_parts(model, layout)
    attention = 4.0 * layout.dim * seq_len if layout.dim else 0.0
    return [(sum(2.0 * sub.weight.numel() if isinstance(sub, nn.Linear) else sub.forward_flops_per_token()
                 for m in modules for sub in m.modules()
                 if isinstance(sub, nn.Linear) or hasattr(sub, "forward_flops_per_token")),
             attention if 0 < i < len(parts) - 1 else 0.0) for i, modules in enumerate(parts)]


def memory_bytes(model: nn.Module, layout: ModelLayout, *, tokens: float, tp: int, loss_sharded: bool,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes one microbatch moves in the work the FLOP model does not count, {"pre W", "post F", "post I"}
    (docs/pipeline.md, "Memory traffic"). ``loss_sharded``: the logits stay split over the tp ranks."""
    # the weights of each embedding on one rank: tensor parallelism splits the vocabulary-sized ones
    embedding = sum(sub.weight.numel() / (tp if sub.num_embeddings == layout.vocab_size else 1)
                    for n in layout.pre if (m := getattr(model, n, None)) is not None
                    for sub in m.modules() if isinstance(sub, nn.Embedding))
    logits = tokens * (layout.vocab_size or 0) / (tp if loss_sharded else 1)
    cast = 4 + dtype_bytes if dtype_bytes != 4 else 0  # to fp32 and back: each reads one and writes the other
    return {"pre W": 4.0 * embedding * 4, "post F": logits * (12 + cast), "post I": logits * (16 + cast)}


def flop_costs(flops: list[tuple[float, float]], *, tokens: float, tp: int, recompute: list[bool],
               flops_per_second: float | None, send_bytes: float, link_bytes_per_second: float,
               link_latency: float, memory: dict[str, float] | None = None,
               memory_bytes_per_second: float | None = None) -> PartCosts:
    """PartCosts of the FLOP model. ``flops``: ``part_flops``; ``tokens``: tokens of one microbatch on one
    rank; ``recompute[i]``: block i is activation-checkpointed; ``flops_per_second``: achieved device
    throughput (None: relative units, no communication); ``memory`` (``memory_bytes``) at
    ``memory_bytes_per_second``: added in seconds (with ``flops_per_second`` only)."""
    fwd, inp, wgt = [], [], []
    for i, (mm, attn) in enumerate(flops):
        block = 0 < i < len(flops) - 1
        f = tokens * (mm + attn) / tp
        fwd.append(f)
        inp.append(tokens * (mm + 2 * attn) / tp + (f if block and recompute[i - 1] else 0.0))
        wgt.append(tokens * mm / tp)
    if flops_per_second:
        scale, unit, send = 1.0 / flops_per_second, "s", link_latency + send_bytes / link_bytes_per_second
        source = f"FLOP model at {flops_per_second / 1e12:g} TFLOP/s per device"
    else:
        blocks = fwd[1:-1]
        scale, unit, send = 1.0 / (sum(blocks) / len(blocks)), "units", 0.0
        source = "FLOP model"
    parts = {"F": [x * scale for x in fwd], "I": [x * scale for x in inp], "W": [x * scale for x in wgt]}
    if flops_per_second and memory and memory_bytes_per_second:
        for key, moved in memory.items():
            part, kind = key.split()
            parts[kind][0 if part == "pre" else -1] += moved / memory_bytes_per_second
        source += f", memory at {memory_bytes_per_second / 1e9:g} GB/s"
    parts = {k: tuple(v) for k, v in parts.items()}
    parts["B"] = tuple(i + w for i, w in zip(parts["I"], parts["W"], strict=True))
    return PartCosts(parts, dict.fromkeys(KINDS, 0.0), send, unit, source)


def calibrated_costs(model_costs: PartCosts, fit: dict, *, send: float, source: str,
                     measured_counts: tuple[int, ...] | None = None) -> PartCosts:
    """PartCosts in seconds from ``fit_costs``'s result; kinds the run did not measure are derived:
    B = I + W, or I and W as the FLOP model divides B."""
    parts: dict[str, tuple[float, ...]] = {}
    overhead: dict[str, float] = {}
    for kind, f in fit.items():
        units = model_costs.parts[kind]
        parts[kind] = (f["pre_s"], *(f["per_unit_s"] * u for u in units[1:-1]), f["post_s"])
        overhead[kind] = f["overhead_s"]
    if "B" not in parts and "I" in parts and "W" in parts:
        parts["B"] = tuple(i + w for i, w in zip(parts["I"], parts["W"], strict=True))
        overhead["B"] = overhead["I"] + overhead["W"]
    if "B" in parts and ("I" not in parts or "W" not in parts):
        for kind in ("I", "W"):
            share = [m / b if b else 0.5 for m, b in zip(model_costs.parts[kind], model_costs.parts["B"], strict=True)]
            parts[kind] = tuple(x * s for x, s in zip(parts["B"], share, strict=True))
            overhead[kind] = overhead["B"] / 2
    if "F" not in parts or "B" not in parts:
        raise ConfigError(f"{COST_FILE_KEY}: the measured run has no forward and backward actions")
    return PartCosts(parts, overhead, send, "s", source, measured_counts)


def write_cost_file(path: Path, *, identity: dict, measured: dict, fit: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "job": identity, "measured": measured, "fit": fit}, indent=1))
    tmp.replace(path)


# What must match between the measured run and the planned job, and the key that sets each.
IDENTITY_KEYS = {"model": "[model] name / flavor / overrides",
                 "n_layers": "[model] flavor / overrides (the number of blocks)",
                 "seq_len": "[training] seq_len", "microbatch_size": "[parallelism] pipeline_parallel_microbatch_size",
                 "tp": "[parallelism] tensor_parallel_degree", "cp": "[parallelism] context_parallel_degree",
                 "activation_checkpoint": "[activation_checkpoint] mode", "dtype": "[training] mixed_precision_param",
                 "attention": "[model] attn_mask_type / attn_backend"}


def read_cost_file(path: str, identity: dict) -> dict:
    """The measured file's content, checked entry by entry; refused with one line naming the key and the entry
    when it is not a cost file or does not describe this job."""
    p = Path(path)
    try:
        data = read_json(p, COST_FILE_KEY, what="pipeline cost file written by a timed run")
        fit, job, measured = (_entry(data, name, dict, p, name) for name in ("fit", "job", "measured"))
        for name, sets in IDENTITY_KEYS.items():
            if job.get(name) != identity[name]:
                raise ConfigError(f"{COST_FILE_KEY}: {p} was measured with {name} {job.get(name)!r}, this job has"
                                  f" {identity[name]!r} ({sets}); measure again with this job's settings")
        for kind, f in fit.items():
            if kind not in KINDS:
                raise UserError(f"{COST_FILE_KEY}: {p} fit has an action kind {kind!r} (known: {', '.join(KINDS)})")
            _entry(fit, kind, dict, p, f"fit.{kind}")
            for name in ("pre_s", "post_s", "per_unit_s", "overhead_s"):
                _entry(f, name, (int, float), p, f"fit.{kind}.{name}", seconds=True)
        if not any(f[name] for f in fit.values() for name in ("pre_s", "post_s", "per_unit_s")):
            raise UserError(f"{COST_FILE_KEY}: {p} fit: every cost is 0 (nothing to plan from); time the run again")
        _entry(measured, "transfer_s", (int, float), p, "measured.transfer_s", required=False, seconds=True)
        counts = _entry(measured, "counts", list, p, "measured.counts", required=False)
        if counts is not None and not all(type(c) is int and 0 <= c <= MAX_BLOCKS for c in counts):
            raise UserError(f"{COST_FILE_KEY}: {p} measured.counts = {counts!r}: expected the blocks per stage")
    except UserError as e:
        raise ConfigError(str(e)) from None
    return {"fit": fit, "measured": measured}


MAX_BLOCKS = 100_000
MAX_SECONDS = 1e6  # a cost of days per action is a broken file, and sums of such overflow


def _entry(data: dict, name: str, types, path: Path, where: str, *, required: bool = True, seconds: bool = False):
    """``data[name]`` of ``types`` (``where``: its place in the file, for the error); ``seconds``: a time, finite,
    from 0 to MAX_SECONDS."""
    value = entry(data, name, types, path, COST_FILE_KEY, required=required, where=where)
    if seconds and value is not None and not 0 <= value <= MAX_SECONDS:
        raise UserError(f"{COST_FILE_KEY}: {path} {where} = {value!r}: expected seconds from 0 to {MAX_SECONDS:g}")
    return value


def split_memory_limit(parallelism: Parallelism, this_device: bool = True) -> float | None:
    """Bytes each pipeline rank may hold in the split search: ``pipeline_parallel_memory_limit_gib``, else (0) this
    machine's device memory (``this_device``; none for a dry run, which plans for other machines)."""
    return parallelism.pipeline_parallel_memory_limit_gib * 2**30 or (device_memory_bytes() if this_device else None)


def cost_identity(config: JobConfig, n_blocks: int, tp: int, cp: int) -> dict:
    """What a measured pipeline cost file must share with the job it plans (``IDENTITY_KEYS``)."""
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
    measured = read_cost_file(p.pipeline_parallel_cost_file, cost_identity(config, n_blocks, dims.tp, dims.cp))
    where = measured["measured"]
    send = where.get("transfer_s", link["link_latency"] + send_bytes / link["link_bytes_per_second"])
    counts = where.get("counts")
    how = (f"{where['method']} ({where.get('device')}); transfers priced by the link settings" if "method" in where
           else f"{where.get('schedule')} on {where.get('device')}, split {where.get('split_points')}")
    return calibrated_costs(units, measured["fit"], send=send, measured_counts=tuple(counts) if counts else None,
                            source=f"measured ({p.pipeline_parallel_cost_file}: {how})")


def loss_gradient_bytes(config: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims, sequences: int) -> float:
    """What the loss's backward allocates for a microbatch of ``sequences``: 8 bytes a logit of the rank's tokens,
    the vocabulary split over tp under loss parallelism."""
    vocab = spec.vocab_size(args)
    if dims.tp > 1 and not config.parallelism.disable_loss_parallel:
        vocab /= dims.tp
    return LOSS_GRADIENT_BYTES * sequences * (config.training.seq_len // dims.cp) * vocab


class SplitMemory:
    """Each pipeline rank's bytes for a split, the dry run's memory table (docs/pipeline.md, "Memory limits");
    ``fits`` holds a split to ``limit`` (None: no limit)."""

    def __init__(self, config: JobConfig, spec: ModelSpec, args: Any, whole: nn.Module, dims: ParallelDims,
                 device: str, n_micro: int, limit: float | None = None):
        from trainer.activation_memory import activation_sections, part_activations

        p = config.parallelism
        self.dims, self.limit, self.n_micro = dims, limit, n_micro
        self.params = part_params(whole, spec.layout(args))
        dtype = compute_dtype(config.training.mixed_precision_param, device)
        self.per_part = part_activations(spec, args, dims, dtype.itemsize, **activation_sections(config))
        self.schedule, self.traits = schedule_traits(p)
        self.tokens = p.pipeline_parallel_microbatch_size * config.training.seq_len
        self.loss = loss_gradient_bytes(config, spec, args, dims, p.pipeline_parallel_microbatch_size)
        self._walked: list = []  # each rank's actions, walked once for every split priced

    def rank_bytes(self, counts: tuple[int, ...], placement: list[list[int]]) -> list[float]:
        """Bytes of each pipeline rank for stages of ``counts`` blocks, rank r holding stages ``placement[r]``."""
        from trainer.activation_memory import rank_actions, rank_peaks

        dims, last = self.dims, len(counts) - 1
        state = stage_sums(self.params, counts)
        acts = [0.0] * dims.pp
        if not self.traits.from_file and not isinstance(self.per_part, str):
            if not self._walked:
                ops = schedule_ops(self.schedule, dims.pp, self.n_micro, len(counts) // dims.pp)
                self._walked = rank_actions(lowered(ops)[0])
            acts = rank_peaks(self.per_part, counts, self._walked, self.tokens)
        return [sum(state[s] for s in placement[r]) * BYTES_PER_PARAM / (dims.dp_shard * dims.cp * dims.tp)
                + acts[r] + (self.loss if last in placement[r] else 0.0) for r in range(dims.pp)]

    def fits(self, counts: tuple[int, ...], placement: list[list[int]]) -> bool:
        return self.limit is None or max(self.rank_bytes(counts, placement)) <= self.limit
