"""Price each part of the model on one device, so a pipeline plan uses measured costs before any pipeline runs.

    python -m trainer.measure_costs --job.config_file JOB.toml [--section.key value ...] [--device cuda]
                                    [--steps 10] [--out FILE]

Builds the job's whole model on one device, in the job's compute dtype and with its activation
checkpointing, and runs ``--steps`` microbatches of the job's pipeline microbatch size and sequence
length (after two untimed ones). Each microbatch is timed at the model's part boundaries: the
embedding (pre), each block, and the final norm, output projection and loss (post), in the forward,
in the full backward, and in an input-gradient pass (autograd asked for the first block's input
gradient only, so no weight gradient is computed, as in a zero-bubble schedule's I action); a part's
weight gradient (W) is its full backward less its input gradient. On CUDA the boundaries are CUDA
events (the kernels' own times); elsewhere the wall clock.

The medians are written as a pipeline cost file (default ``<dump_folder>/<save_traces_folder>/
pipeline_costs.json``, the file a timed pipeline run writes) that ``--dry-run
--parallelism.pipeline_parallel_cost_file FILE`` plans with. What one device cannot measure is priced
as before, and said in the output: a transfer between pipeline ranks (the link settings), the cost
each action adds besides its parts (zero; a timed pipeline run measures it), tensor and context
parallelism (refused: measure a job with both degrees 1).
"""

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

from trainer.errors import ConfigError, UserError, one_line
from trainer.pipeline.simulate import KINDS

USAGE = ("usage: python -m trainer.measure_costs --job.config_file JOB.toml [--section.key value ...] [--device DEVICE]"
         " [--steps N] [--out FILE]")
WARMUP = 2
MAX_STEPS = 1000


class PartClock:
    """Marks taken at part boundaries during one microbatch; on CUDA as events, read after a synchronise."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        self.marks: dict = {}

    def mark(self, key) -> None:
        if key in self.marks:  # the first crossing counts (a recomputation crosses again)
            return
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[key] = event
        else:
            self.marks[key] = time.perf_counter_ns()

    def seconds(self, a, b) -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return (self.marks[b] - self.marks[a]) / 1e9


def time_parts(model, blocks: list, inputs, labels, loss_fn, *, steps: int, warmup: int = WARMUP) -> dict:
    """Median seconds of each part (pre, every block, post) per kind: {"F" | "B" | "I" | "W": [pre, b0 .. bn-1,
    post]}, over ``steps`` microbatches after ``warmup``. ``blocks``: the model's blocks in the order they run."""
    import torch

    from trainer.profiling.timeline import hook_block_boundaries

    n = len(blocks)
    state = {"clock": None, "kind": None, "first_input": None}
    # boundaries are marked in a timed forward (not in a backward's recomputation) and as the backward reaches them
    handles = hook_block_boundaries(blocks, lambda: state["clock"] is not None and state["kind"] == "F",
                                    lambda boundary: state["clock"].mark((state["kind"], boundary)),
                                    lambda hidden: state.update(first_input=hidden))
    samples: dict[str, list[list[float]]] = {k: [] for k in ("F", "B", "I")}
    try:
        for step in range(warmup + steps):
            for kind in ("B", "I"):  # each backward needs its own forward; the first one's forward is timed
                clock = state["clock"] = PartClock(inputs.device)
                state["kind"] = "F"
                clock.mark(("F", "start"))
                loss = loss_fn(model(inputs), labels)
                clock.mark(("F", "end"))
                state["kind"] = kind
                clock.mark((kind, "start"))
                if kind == "B":
                    loss.backward()
                else:
                    torch.autograd.grad(loss, [state["first_input"]])
                clock.mark((kind, "end"))
                state["kind"] = None
                if inputs.device.type == "cuda":
                    torch.cuda.synchronize()
                if step < warmup:
                    continue
                s = clock.seconds
                if kind == "B":
                    samples["F"].append([s(("F", "start"), ("F", 0)),
                                         *(s(("F", i), ("F", i + 1)) for i in range(n)), s(("F", n), ("F", "end"))])
                first = (kind, 0) if (kind, 0) in clock.marks else (kind, "end")
                samples[kind].append([s(first, (kind, "end")) if kind == "B" else 0.0,
                                      *(s((kind, i + 1), (kind, i) if i else first) for i in range(n)),
                                      s((kind, "start"), (kind, n))])
            model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
        state["clock"] = None
    out = {k: [statistics.median(column) for column in zip(*rows, strict=True)] for k, rows in samples.items()}
    out["W"] = [max(b - i, 0.0) for b, i in zip(out["B"], out["I"], strict=True)]
    return out


def time_whole(model, inputs, labels, loss_fn, *, steps: int, warmup: int = WARMUP) -> float:
    """Median seconds of one microbatch's forward and full backward with no part marked (what the parts' marks
    cost is the difference from their sum)."""
    import torch

    samples = []
    for step in range(warmup + steps):
        clock = PartClock(inputs.device)
        clock.mark("start")
        loss_fn(model(inputs), labels).backward()
        clock.mark("end")
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            samples.append(clock.seconds("start", "end"))
        model.zero_grad(set_to_none=True)
    return statistics.median(samples)


def fit_from_parts(units, measured: dict) -> dict:
    """The cost file's fit (``calibrate.fit_costs``' shape) from per-part seconds: each kind's block price is
    its blocks' measured total over their FLOP-model units, pre and post as measured, no per-action cost."""
    fit = {}
    for kind, values in measured.items():
        block_units = math.fsum(units.parts[kind][1:-1])
        blocks = math.fsum(values[1:-1])
        fit[kind] = {"overhead_s": 0.0, "lead_overhead_s": 0.0, "tail_overhead_s": 0.0,
                     "per_unit_s": blocks / block_units if block_units else 0.0,
                     "pre_s": values[0], "post_s": values[-1]}
    return fit


def check_fits(plan, config, device, dtype) -> None:
    """Refuse, before anything is allocated, a measurement that cannot fit on the device: the whole model's
    parameters and gradients in ``dtype``, one microbatch's activations (where the family estimates them) and its
    float32 logits and their gradient."""
    import torch

    from trainer.activation_memory import activation_sections, part_activations
    from trainer.parallel.dims import ParallelDims
    from trainer.env import device_memory_bytes

    batch, seq = config.parallelism.pipeline_parallel_microbatch_size, config.training.seq_len
    tokens = batch * seq
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    per_part = part_activations(plan.spec, plan.model_args, one, dtype.itemsize, **activation_sections(config))
    activations = 0.0 if isinstance(per_part, str) else tokens * (sum(per_part.kept) + per_part.stage
                                                                    + max(per_part.recompute))
    need = plan.num_params * 2 * dtype.itemsize + activations + tokens * plan.vocab_size * 8
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory
    else:
        available = device_memory_bytes() if device.type == "cpu" else 1 << 62
    if need > available:
        raise UserError(f"[parallelism] pipeline_parallel_microbatch_size={batch}, [training] seq_len={seq}: timing the"
                        f" whole model ({plan.num_params:,} parameters) on one microbatch needs ~{need / 2**30:,.1f}"
                        f" GiB on {device}, more than its {available / 2**30:,.1f} GiB; measure a smaller microbatch"
                        " or sequence, or measure in a timed pipeline run (--profiling.pipeline_timeline_steps)")


def measure(config, *, device_name: str, steps: int, out: str | None) -> tuple[Path, list[str]]:
    """Time the job's parts on ``device_name`` and write the cost file; returns its path and the lines to print."""
    import torch

    from trainer.models.init import materialize_
    from trainer.models.registry import model_blocks
    from trainer.parallel.ac import apply_ac
    from trainer.convert import cast_parameters_
    from trainer.loss import cross_entropy_sum
    from trainer.dtypes import compute_dtype
    from trainer.pipeline.cost import cost_identity, pipeline_costs, write_cost_file
    from trainer.plan import build_job_plan, degrees_product

    p = config.parallelism
    for degree, key in ((p.tensor_parallel_degree, "tensor_parallel_degree"),
                        (p.context_parallel_degree, "context_parallel_degree")):
        if degree > 1:
            raise ConfigError(f"[parallelism] {key} = {degree}: one device measures the parts unsharded; measure the"
                              f" job with {key} = 1 (a timed pipeline run, --profiling.pipeline_timeline_steps,"
                              " measures a sharded job)")
    plan = build_job_plan(config, degrees_product(config), check_memory=False)
    # [model] attn_mask_type made concrete ("auto" resolved), as the jobs it plans have it
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, attn_mask_type=plan.attn_mask_type))
    device = torch.device(device_name)
    dtype = compute_dtype(config.training.mixed_precision_param, device.type)
    check_fits(plan, config, device, dtype)
    model = plan.build_model()
    materialize_(model, device, plan.seed)
    cast_parameters_(model, dtype)  # as FSDP's mixed precision computes: parameters cast, buffers kept
    ac = config.activation_checkpoint
    apply_ac(model, mode=ac.mode, option=ac.selective_ac_option, layers_attr=plan.spec.layers_attr)
    blocks = list(model_blocks(model, plan.spec.layers_attr).values())
    batch = p.pipeline_parallel_microbatch_size
    generator = torch.Generator().manual_seed(plan.seed)
    inputs = torch.randint(plan.vocab_size, (batch, config.training.seq_len), generator=generator).to(device)
    labels = torch.randint(plan.vocab_size, (batch, config.training.seq_len), generator=generator).to(device)
    try:
        measured = time_parts(model, blocks, inputs, labels, cross_entropy_sum, steps=steps)
        whole = time_whole(model, inputs, labels, cross_entropy_sum, steps=steps)
    except torch.OutOfMemoryError as e:
        raise UserError(f"--device {device_name}: out of memory running the whole model ({plan.num_params:,}"
                        f" parameters) on one microbatch of {batch} x {config.training.seq_len} tokens"
                        f" ({one_line(e)[:120]}); time it with a smaller [training] seq_len or [parallelism]"
                        " pipeline_parallel_microbatch_size, or measure in a timed pipeline run") from None
    parts_sum = sum(measured["F"]) + sum(measured["B"])
    units = pipeline_costs(config, plan.spec, plan.model_args, model, plan.dims, device.type, relative=True)
    path = Path(out or Path(config.job.dump_folder) / config.profiling.save_traces_folder / "pipeline_costs.json")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        write_cost_file(path, identity=cost_identity(config, len(blocks), 1, 1), fit=fit_from_parts(units, measured),
                        measured={"method": "parts timed on one device", "device": name, "steps": steps,
                                  "parts_s": measured, "whole_s": whole, "dtype": str(dtype).removeprefix("torch.")})
    except OSError as e:
        raise UserError(f"--out {path}: cannot write it ({one_line(e)[:200]})") from None
    lines = [f"timed {steps} microbatches of {batch} x {config.training.seq_len} tokens on {name}"
             f" ({str(dtype).removeprefix('torch.')}, activation checkpointing {ac.mode}); median ms per microbatch:"]
    for kind in KINDS:
        v = measured[kind]
        lines.append(f"  {kind}: embedding {1e3 * v[0]:.3f}, a block {1e3 * statistics.fmean(v[1:-1]):.3f}"
                     f" (min {1e3 * min(v[1:-1]):.3f}, max {1e3 * max(v[1:-1]):.3f}),"
                     f" output and loss {1e3 * v[-1]:.3f}")
    lines.append(f"the parts' F + B sum to {1e3 * parts_sum:.3f} ms, {100 * parts_sum / whole:.1f}% of a forward and"
                 f" backward timed whole ({1e3 * whole:.3f} ms; the difference is what marking the parts costs, and"
                 " noise)")
    lines.append(f"wrote {path}; plan with it: --dry-run --parallelism.pipeline_parallel_cost_file {path}"
                 " (not measured here, priced as before: transfers between pipeline ranks, by the link settings;"
                 " the per-action cost of the schedule, as zero)")
    if config.compile.enable:
        lines.append("note: [compile] enable = true, but the parts were timed eagerly (compiled blocks cannot be"
                     " timed at their boundaries)")
    return path, lines


def run(argv: list[str]) -> int:
    from trainer.log import init_config_logging

    init_config_logging()
    from trainer.convert import CommandParser, command_device, help_or_usage, report

    if (status := help_or_usage(argv, __doc__, USAGE)) is not None:
        return status

    parser = CommandParser("python -m trainer.measure_costs", USAGE)
    parser.add_argument("--device", default="")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out")
    try:
        known, rest = parser.parse_known_args(argv)
        if not 1 <= known.steps <= MAX_STEPS:
            raise UserError(f"--steps {known.steps}: must be in 1 .. {MAX_STEPS}")
        from trainer.config import load_config

        if flags := [a for a in rest if a.split("=")[0] in ("--dry-run", "--print-config", "--world-size",
                                                            "--compare-schedules")]:
            raise UserError(f"{flags[0]}: a flag of train.py, not of measure_costs (which always times on this"
                            " machine); drop it")
        device = command_device(known.device, ("cpu", "cuda"), "use cpu, cuda or cuda:N")
        config = load_config(overrides=rest)
        _, lines = measure(config, device_name=device, steps=known.steps, out=known.out)
    except UserError as e:
        return report(e, USAGE)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
