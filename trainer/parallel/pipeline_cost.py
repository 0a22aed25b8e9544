"""What each pipeline action costs: forward (F), full backward (B), input gradient (I) and weight
gradient (W) of every stage, and the time of one transfer between pipeline ranks.

The model is cut into parts: the modules before the blocks (pre: embeddings), each block, the
modules after them (post: final norm, output projection). A stage's action costs are the sums
over its parts plus a fixed cost per action, so every contiguous split is priced from one table.

From the model (``flop_costs``), per microbatch:
- a Linear (and modules reporting ``forward_flops_per_token``, e.g. the k routed experts): forward
  2 FLOPs per weight and token, input gradient as much, weight gradient as much;
- attention scores (no weights): forward 4 x dim x seq_len per token, input gradient twice that,
  no weight gradient;
- a block under activation checkpointing runs its forward again in its input-gradient pass;
- tensor parallelism divides every matmul by tp; context parallelism the tokens of a rank by cp.
Without a throughput the unit is relative (1 = the mean block's forward of one microbatch) and
communication is not modelled; with ``pipeline_parallel_device_tflops`` it is seconds, and a
transfer costs latency + bytes / bandwidth (the activation of one microbatch).

What the FLOPs leave out, priced in seconds when ``pipeline_parallel_device_memory_gbytes_per_second``
is also given (``memory_bytes``): the bytes of the two parts whose work is passes over memory, not
matmuls. With E logits of one microbatch (tokens x vocabulary, over tp when the loss runs on
vocabulary shards) and c bytes per element of the compute dtype:
- the loss's forward: a cast of the logits to fp32 (read c, write 4; none when c is 4), then the
  log-softmax reads them twice and writes once: E x (12 + c + 4);
- the loss's input gradient: the loss's gradient written (4), the log-softmax's backward reads two
  tensors and writes one (12), the cast back (read 4, write c): E x (16 + 4 + c);
- the embedding's weight gradient: a dense gradient of every row written, then read with the
  gradient accumulated over the step's microbatches and the sum written: 4 x its weights x 4 (float32
  gradients: autocast keeps the parameters in float32, FSDP accumulates in its reduce dtype). An upper
  bound: a step's first microbatch writes its gradient once, and FSDP's bf16 parameters get a bf16
  fresh gradient (12 bytes per weight, not 16). Under tensor parallelism a vocabulary-sized
  embedding is split over the tp ranks.

From a measured run (``fit_costs``, written by the pipeline timeline to ``pipeline_costs.json``,
read back with ``pipeline_parallel_cost_file``): seconds per action kind fitted to the measured
per-stage mean durations as overhead + seconds per block unit x block units + pre + post, with the
overhead, pre and post pinned by the times the timeline measured before and after each stage's blocks.
"""

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.errors import ConfigError, UserError
from trainer.jsonfile import entry, read_json
from trainer.models.registry import ModelLayout, model_blocks

KINDS = ("F", "B", "I", "W")
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
        table, start = [], 1
        bounds = []
        for c in counts:
            bounds.append((start, start + c))
            start += c
        last = len(counts) - 1
        for kind in KINDS:
            values, over = self.parts[kind], self.overhead[kind]
            row = []
            for s, (a, b) in enumerate(bounds):
                row.append(over + math.fsum(values[a:b]) + (values[0] if s == 0 else 0.0)
                           + (values[-1] if s == last else 0.0))
            table.append(row)
        # torch's split backward skips the input-gradient pass of the first stage (its inputs are token
        # ids: nothing to compute) and runs that stage's whole backward, one fused pass, as its weight
        # gradient.
        i, w, b = KINDS.index("I"), KINDS.index("W"), KINDS.index("B")
        table[w][0] = table[b][0]
        table[i][0] = 0.0
        return table


def part_flops(model: nn.Module, layout: ModelLayout, *, seq_len: int) -> list[tuple[float, float]]:
    """(matmul FLOPs, attention-score FLOPs) of one token's forward through each part: pre, each block, post.

    Matmuls: 2 per weight of each Linear (embedding lookups are free) plus what modules with a
    ``forward_flops_per_token()`` method report (routed experts: the k chosen). Attention scores:
    4 * dim * seq_len per block when the layout knows the hidden size."""
    dim = layout.dim

    def matmuls(modules: list[nn.Module]) -> float:
        total = 0.0
        for m in modules:
            total += sum(2.0 * sub.weight.numel() for sub in m.modules() if isinstance(sub, nn.Linear))
            total += sum(sub.forward_flops_per_token() for sub in m.modules()
                         if hasattr(sub, "forward_flops_per_token"))
        return total

    def present(names: tuple[str, ...]) -> list[nn.Module]:
        return [getattr(model, n) for n in names if getattr(model, n, None) is not None]

    blocks = [(matmuls([b]), 4.0 * dim * seq_len if dim else 0.0) for b in model_blocks(model, layout.blocks).values()]
    return [(matmuls(present(layout.pre)), 0.0), *blocks, (matmuls(present(layout.post)), 0.0)]


def memory_bytes(model: nn.Module, layout: ModelLayout, *, tokens: float, tp: int, loss_sharded: bool,
                 dtype_bytes: int) -> dict[str, float]:
    """Bytes one microbatch moves through memory in the work the FLOP model does not count (module docstring):
    {"pre W": the embedding's weight gradient, "post F": the loss's forward, "post I": the loss's input
    gradient}. ``loss_sharded``: the logits stay split over the tp ranks' vocabulary shards."""
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


# -- calibration from a measured timeline --------------------------------------------------------

def fit_costs(model_costs: PartCosts, counts: list[int], actions: list[tuple[str, int, float]],
              parts: list[tuple[str, int, str, float]] = ()) -> dict:
    """Seconds per action kind fitted to measured actions (kind, stage, seconds) of a run split into
    stages of ``counts`` blocks: each kind's stage duration = lead overhead + tail overhead + per_unit x
    (the FLOP model's units of its blocks) + pre (first stage) + post (last stage). Least squares on the
    per-stage means (a step lasts the sum of its actions, so the mean, not the median, is what predicts
    it), pulled weakly towards the FLOP model scaled to the measured total, which decides what the
    measurements cannot (two stages cannot separate five numbers). The first stage's weight-gradient
    actions of a split backward are its whole backward (``PartCosts.stage_table``): they count as its
    B; its input-gradient actions compute nothing.

    ``parts`` (kind, stage, "lead" or "tail", seconds): what the actions spent before and after their
    blocks, timed at the block boundaries (``profiling.timeline.part_seconds``). A stage's mean lead is
    the lead overhead (plus pre on the first stage), its mean tail the tail overhead (plus post on the
    last): each pins those unknowns like ten stage measurements, so one run separates a block from the
    cost of every action around it, the embedding's gradient and the loss."""
    def fitted_kind(kind: str, stage: int) -> str | None:
        """The first stage's split backward: its W is its whole backward (B), its I computes nothing."""
        return {"I": None, "W": "B"}.get(kind, kind) if stage == 0 else kind

    samples: dict[tuple[str, int], list[float]] = {}
    for kind, stage, seconds in actions:
        if (fitted := fitted_kind(kind, stage)) is not None:
            samples.setdefault((fitted, stage), []).append(seconds)
    own: dict[tuple[str, str, int], list[float]] = {}
    for kind, stage, part, seconds in parts:
        if (fitted := fitted_kind(kind, stage)) is not None:
            own.setdefault((fitted, part, stage), []).append(seconds)
    fit = {}
    last = len(counts) - 1
    starts = [1 + sum(counts[:s]) for s in range(len(counts))]
    # unknowns: lead overhead, tail overhead, seconds per block unit, pre, post
    for kind in ("F", "I", "W", "B"):  # B last: a split backward measures it on the first stage alone
        stages = sorted(s for k, s in samples if k == kind)
        if not stages:
            continue
        units = model_costs.parts[kind]
        y = [statistics.fmean(samples[(kind, s)]) for s in stages]
        rows = [[1.0, 1.0, math.fsum(units[starts[s]:starts[s] + counts[s]]), float(s == 0), float(s == last)]
                for s in stages]
        modelled = [r[2] + units[0] * r[3] + units[-1] * r[4] for r in rows]
        sigma = sum(y) / sum(modelled)  # seconds per unit, over the whole measured step
        prior = [0.0, 0.0, sigma, sigma * units[0], sigma * units[-1]]
        if kind == "B" and "I" in fit and "W" in fit and 0 in stages:
            # A fused backward does what the input and weight gradients do, in one pass: their fitted sum
            # is what the measurements leave open. What the fused ones measured beyond it is the
            # embedding's gradient (the first stage's part no I or W measured); short of it, the fused
            # pass saves that share of the work.
            block_units = {k: math.fsum(model_costs.parts[k][1:-1]) for k in "IWB"}
            i, w = fit["I"], fit["W"]
            both = [i["lead_overhead_s"] + w["lead_overhead_s"], i["tail_overhead_s"] + w["tail_overhead_s"],
                    (i["per_unit_s"] * block_units["I"] + w["per_unit_s"] * block_units["W"]) / block_units["B"],
                    i["pre_s"] + w["pre_s"], i["post_s"] + w["post_s"]]
            predicted = [math.fsum(v * x for v, x in zip(both, r, strict=True)) for r in rows]
            first = stages.index(0)
            both[3] += max(y[first] - predicted[first], 0.0)
            predicted[first] = max(y[first], predicted[first])
            prior = [v * sum(y) / sum(predicted) for v in both]
        # Each prior row weighs like 1/100 of a stage measurement of a block's size: it settles only what
        # the measurements leave open.
        size = [sigma, sigma, sigma, sigma * max(units[0], 1.0), sigma * max(units[-1], 1.0)]
        a = [[v / sigma for v in r] for r in rows] + [[0.01 * sigma / size[j] * (i == j) for i in range(5)]
                                                       for j in range(5)]
        b = [v / sigma for v in y] + [0.01 * sigma / size[j] * prior[j] for j in range(5)]
        timed: dict[str, dict[str, float]] = {}
        # A timed lead or tail weighs like ten stage measurements: it measures its unknowns directly, while a
        # stage's duration also holds its blocks, whose pace differs between ranks in ways the costs do not
        # model (a rank that waits much runs its blocks slower on a shared CPU): that difference goes to
        # the price of a block, not into the parts around it.
        for part, overhead, own_part, own_stage in (("lead", 0, 3, 0), ("tail", 1, 4, last)):
            for s in stages:
                if own.get((kind, part, s)):
                    mean = timed.setdefault(part, {})[str(s)] = statistics.fmean(own[(kind, part, s)])
                    a.append([10.0 * (j == overhead or (j == own_part and s == own_stage)) / sigma for j in range(5)])
                    b.append(10.0 * mean / sigma)
        lead, tail, per_unit, pre, post = _nonnegative_lstsq(a, b)
        fit[kind] = {"overhead_s": lead + tail, "lead_overhead_s": lead, "tail_overhead_s": tail,
                     "per_unit_s": per_unit, "pre_s": pre, "post_s": post,
                     "stage_mean_s": dict(zip(map(str, stages), y, strict=True))}
        if timed:
            fit[kind]["part_mean_s"] = timed
    return fit


def _nonnegative_lstsq(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares with every unknown >= 0: an unknown that comes out negative is fixed at 0 and the
    rest solved again (a duration has no negative part)."""
    free = list(range(len(a[0])))
    while True:
        cols = torch.tensor([[row[j] for j in free] for row in a], dtype=torch.float64)
        x = torch.linalg.lstsq(cols, torch.tensor(b, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1).tolist()
        negative = [j for j, v in zip(free, x, strict=True) if v < 0]
        if not negative:
            out = [0.0] * len(a[0])
            for j, v in zip(free, x, strict=True):
                out[j] = v + 0.0  # no -0.0
            return out
        free = [j for j in free if j not in negative]


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
        _check_identity(job, identity, p)
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


def _check_identity(job: dict, identity: dict, path: Path) -> None:
    for name, sets in IDENTITY_KEYS.items():
        if job.get(name) != identity[name]:
            raise ConfigError(f"{COST_FILE_KEY}: {path} was measured with {name} {job.get(name)!r}, this job has"
                              f" {identity[name]!r} ({sets}); measure again with this job's settings")


MAX_BLOCKS = 100_000
MAX_SECONDS = 1e6  # a cost of days per action is a broken file, and sums of such overflow


def _entry(data: dict, name: str, types, path: Path, where: str, *, required: bool = True, seconds: bool = False):
    """``data[name]`` of ``types`` (``where``: its place in the file, for the error); ``seconds``: a time, finite,
    from 0 to MAX_SECONDS."""
    value = entry(data, name, types, path, COST_FILE_KEY, required=required, where=where)
    if seconds and value is not None and not 0 <= value <= MAX_SECONDS:
        raise UserError(f"{COST_FILE_KEY}: {path} {where} = {value!r}: expected seconds from 0 to {MAX_SECONDS:g}")
    return value

