"""The dry run: the job plan as text, before any device is spent. No process group needed.

``python train.py --job.config_file configs/llama3_8b.toml --dry-run --world-size 64``
"""

import dataclasses
import logging
from pathlib import Path

import torch

from trainer.config.schedules import SCHEDULES
from trainer.config.validate import is_prepared_path, mix_entries, validate_config
from trainer.errors import UserError
from trainer.parallel.mesh import DIM_NAMES, EP_DIM_NAMES
from trainer.pipeline.search import Simulator, search_splits
from trainer.pipeline.simulate import program_for, schedule_text
from trainer.plan import JobPlan, build_job_plan

DEVICE = "cuda"  # the dry run plans for the job's accelerators: mixed_precision_param "auto" means bf16
LAUNCH_BOUND_BLOCK_S = 2e-4
"""A block's forward priced by the FLOP model below this is likely bound by launching its kernels: eager blocks of
the small models timed on an H100 and an H200 took 0.6-1.1 ms whatever their FLOPs (docs/pipeline.md)."""


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*["-" * w for w in widths])] + [fmt.format(*r) for r in rows]


def _stage_modules(plan: JobPlan, stage) -> str:
    spec = plan.spec
    names = list(spec.pre_layers) if stage.first else []
    keys = stage.blocks
    names.append(f"{spec.layers_attr}.{keys[0]}" + (f"-{keys[-1]}" if len(keys) > 1 else ""))
    names += list(spec.post_layers) if stage.last else []
    return ", ".join(names)


def _split(dataset_path: str, split: str) -> str:
    return "prepared token shards, read whole" if is_prepared_path(dataset_path) else f"split {split!r}"


def _checkpoint_line(checkpoint, world_size: int) -> str:
    """Where and how checkpoints are saved; for saves in the background, which process group they use."""
    line = (f"Checkpoints: every {checkpoint.interval} steps and at the last into <dump>/{checkpoint.folder}"
            f" (DCP, each rank writes its share)")
    if checkpoint.async_mode == "disabled":
        return line + ", in the foreground"
    line += f", in the background ({checkpoint.async_mode!r})"
    if world_size > 1:
        line += f"; their collectives run on a gloo process group of their own ({world_size} ranks)"
    return line


def _data_line(config) -> str:
    t = config.training
    opts = t.dataloader
    if t.dataset_mix:
        source = "mix " + ", ".join(f"{e.name} x{e.weight:g} split {e.split!r}" for e in mix_entries(t))
    else:
        source = f"{t.dataset_path or t.dataset} ({_split(t.dataset_path, opts.split)})"
    streamed = not t.dataset_mix and not t.dataset_path and t.dataset != "python_docs" and opts.streaming
    how = ("streamed: every rank tokenizes the global batch" if streamed else
           f"token shards, each rank reads its windows of {t.seq_len + 1} tokens"
           f"{', shuffled' if opts.shuffle else ''}{', read ahead' if opts.prefetch else ''}")
    return f"Data: {source}; {how}"


def describe_plan(plan: JobPlan) -> str:
    """The plan as text; also writes the schedule timeline into the dump folder when pipelined."""
    config, dims, spec = plan.config, plan.dims, plan.spec
    t, p = config.training, config.parallelism
    shard = plan.param_split  # ways each parameter is split in memory
    lines = [
        f"Plan: {config.job.description}",
        f"Model: {config.model.name} {config.model.flavor}, {plan.num_params / 1e6:,.2f}M parameters,"
        + (f" {(plan.num_params - spec.idle_params(plan.model_args)) / 1e6:,.2f}M active per token,"
           if spec.idle_params else "")
        + f" {plan.flops_per_token / 1e9:.2f} GFLOP/token (training), seq_len {t.seq_len}, attention "
        + ("block_causal (within documents)" if config.model.attn_mask_type == "block_causal" else "causal")
        + (", varlen: each document alone (CPU only)" if config.model.attn_backend == "varlen" else ""),
        f"World: {dims.describe()}",
        "Mesh: (" + ", ".join(f"{n}={getattr(dims, n)}" for n in (EP_DIM_NAMES if dims.ep > 1 else DIM_NAMES))
        + ")"
        + (" with dp_shard = dp_shard_mod_ep x ep; experts sharded over ep" if dims.ep > 1 else ""),
        f"Batch: global {plan.global_batch_size} sequences = {plan.global_batch_parts}",
        _data_line(config),
        f"Metrics reported by rank {plan.reporting_rank}",
    ]
    if config.validation.enable:
        v = config.validation
        what = "the whole set" if v.steps == -1 else f"{v.steps} global batches"
        lines.append(f"Validation: {v.dataset_path or v.dataset} ({_split(v.dataset_path, v.split)}), {what} every"
                     f" {v.freq} steps and after the last, forward only")
    if config.checkpoint.enable:
        lines.append(_checkpoint_line(config.checkpoint, dims.world_size))
    if data_parallel := dims.data_parallel():
        lines.append(f"Data parallel: {data_parallel}")
    if dims.cp > 1:
        lines.append(
            f"Context parallel: each {t.seq_len}-token sequence split over {dims.cp} ranks (chunks i and"
            f" {2 * dims.cp - 1}-i of {2 * dims.cp}), {plan.tokens_per_rank} tokens per rank: activation memory"
            f" per rank / {dims.cp}; attention all-gathers keys and values (kv heads only) over the cp group;"
            f" FSDP shards over dp_shard x cp = {dims.dp_shard * dims.cp} ranks"
        )
    if plan.tp_plan is not None:
        source = "derived automatically" if plan.tp_plan.derived else f"{spec.name}'s own"
        lines.append(f"Tensor parallel plan ({source}; block modules apply to every {spec.layers_attr}.N):")
        lines += plan.tp_plan.describe()
    pipeline = plan.pipeline
    plan.check_traced_dtype(torch.device(DEVICE))  # what the launch on accelerators would refuse
    activations = plan.activation_peaks(DEVICE)
    dtype = str(plan.compute_dtype(torch.device(DEVICE))).removeprefix("torch.")
    if isinstance(activations, str):
        act_note = f"activations not estimated: {activations}"
    else:
        act_note = (f"activations = what autograd saves for backward at the peak of the step, {dtype} compute on"
                    f" accelerators, activation checkpointing {config.activation_checkpoint.mode!r}")
    if pipeline is None:
        lines.append(
            f"No pipeline: every rank runs the whole model; {plan.num_params / 1e6:,.2f}M parameters,"
            f" ~{plan.state_gib_per_device(0):.1f} GiB per device for parameters, gradients and"
            f" Adam state (split {shard} ways by FSDP x CP x TP)"
        )
        if not isinstance(activations, str):
            loss_grad = plan.loss_gradient_bytes() / 2**30
            lines.append(f"Activations: ~{activations[0] / 2**30:.2f} GiB per device (microbatch of"
                         f" {config.training.local_batch_size} x {plan.tokens_per_rank} tokens), and ~{loss_grad:.2f}"
                         f" GiB of the loss's gradient at the start of backward; total"
                         f" ~{plan.state_gib_per_device(0) + activations[0] / 2**30 + loss_grad:.1f} GiB")
        lines.append(f"({act_note})")
        return "\n".join(lines) + "\n"

    lines += [
        f"Pipeline: {pipeline.schedule}"
        + (f" ({p.pipeline_parallel_schedule_csv})" if pipeline.traits.from_file else "")
        + f", {pipeline.num_stages} stages, {pipeline.stages_per_rank} per rank,"
        f" {'V' if pipeline.style == 'v' else 'loop'} placement, {plan.n_microbatches} microbatches of"
        f" {p.pipeline_parallel_microbatch_size} per step",
        f"Split points: {pipeline.split_points()}",
        ("Front-end: tracer (torch.distributed.pipelining.pipeline traces the whole model on CPU once per rank"
         " and cuts the graph before each split point; stages run torch's traced stages)" if plan.traced else
         "Front-end: manual (each stage builds the model class without the other stages' modules)"),
        "",
    ]
    rows = [
        [str(stage.index), str(pipeline.rank_of_stage(stage.index)), _stage_modules(plan, stage),
         f"{plan.stage_params[stage.index] / 1e6:,.1f}M", f"{plan.stage_flops[stage.index] / 1e9:.4g}"]
        for stage in pipeline.stages
    ]
    lines += _table(["stage", "pp rank", "modules", "parameters", "fwd GFLOP/token"], rows)
    lines.append("")
    known = not isinstance(activations, str)
    loss_grad = [plan.loss_gradient_bytes() / 2**30 if r == plan.loss_rank() else 0.0 for r in range(pipeline.pp)]
    totals = _rank_gib(plan, activations)
    mem_rows = [
        [str(r), ", ".join(str(s) for s in pipeline.stage_ids(r)), f"{plan.rank_params(r) / 1e6:,.1f}M",
         f"{plan.state_gib_per_device(r):.2f}",
         f"{activations[r] / 2**30:.2f}" if known else "-", f"{loss_grad[r]:.2f}",
         f"{totals[r]:.2f}" if known else "-"]
        for r in range(pipeline.pp)
    ]
    lines += _table(["pp rank", "stages", "parameters", "state GiB", "activations GiB", "loss gradient GiB",
                     "total GiB"], mem_rows)
    lines.append(
        f"(state: fp32 parameters, gradients and Adam state per device, split {shard} ways by FSDP x CP x TP;"
        f" {act_note})"
    )
    lines += [""] + predicted_step(plan)
    if not pipeline.traits.from_file:
        path = Path(config.job.dump_folder) / "pipeline_schedule.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(schedule_text(pipeline.schedule, pipeline.pp, plan.n_microbatches,
                                          pipeline.stages_per_rank))
        except OSError as e:
            lines.append(f"Schedule timeline (action order per rank) not written: {path}: {e.strerror or e}")
        else:
            lines.append(f"Wrote the schedule timeline (action order per rank) to {path}; the dry run writes nothing"
                         " else")
    return "\n".join(lines) + "\n"


def _amount(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:,.1f} ms" if value < 10 else f"{value:,.2f} s"
    return f"{value:,.1f}"


def _simulator(plan: JobPlan) -> Simulator:
    pipeline = plan.pipeline
    return Simulator(plan.pipeline_costs, program_for(pipeline.schedule, pipeline.pp, plan.n_microbatches,
                                                      pipeline.stages_per_rank, plan.schedule_csv))


def _rank_gib(plan: JobPlan, activations: list[float] | str) -> list[float] | None:
    """Each pipeline rank's state + activations (``plan.activation_peaks``) + loss gradient in GiB, the memory
    table's total (None where the activations are not estimated)."""
    if isinstance(activations, str):
        return None
    loss = plan.loss_gradient_bytes()
    return [plan.state_gib_per_device(r) + (activations[r] + (loss if r == plan.loss_rank() else 0.0)) / 2**30
            for r in range(plan.pipeline.pp)]


def compare_schedules(plan: JobPlan, world_size: int) -> list[str]:
    """``--compare-schedules``: the job planned again under every schedule of the table, each with the split the
    planner chooses for it (split_mode makespan, the same part costs, memory limit and microbatches), against this
    plan: predicted step, the most a rank waits, the most a rank holds in memory. A schedule this job cannot run
    (too few microbatches or blocks, no split within the memory limit, ...) says why."""
    p = plan.config.parallelism
    here = plan.pipeline
    step = _simulator(plan).predict(here.counts)
    unit = plan.pipeline_costs.unit

    def row(name: str, other: JobPlan, mark: str = "") -> tuple[float, list[str]]:
        pred = _simulator(other).predict(other.pipeline.counts)
        gib = _rank_gib(other, other.activation_peaks(DEVICE))
        return pred.makespan, [name + mark, str(other.pipeline.num_stages), _amount(pred.makespan, unit),
                               _signed_percent(pred.makespan / step.makespan - 1),
                               f"{100 * max(map(pred.bubble, range(other.pipeline.pp))):.1f}%",
                               "-" if gib is None else f"{max(gib):.2f}"]

    rows, refused = [row(here.schedule, plan, " (this plan)")], []
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)  # each plan's own warnings (a pipeline that never fills, ...) once is enough
    try:
        for name in SCHEDULES:
            per_stage = ([p.pipeline_parallel_layers_per_stage, None] if p.pipeline_parallel_layers_per_stage
                         else [None])
            why = []
            for layers in per_stage:  # the configured layers per stage where the schedule allows them
                variant = dataclasses.replace(plan.config, parallelism=dataclasses.replace(
                    p, pipeline_parallel_schedule=name, pipeline_parallel_schedule_csv="",
                    pipeline_parallel_split_points=[], pipeline_parallel_split_mode="makespan",
                    pipeline_parallel_layers_per_stage=layers))
                try:
                    validate_config(variant)  # the schedule's own rules (e.g. per-op checkpointing)
                    other = build_job_plan(variant, world_size, check_memory=False)
                except UserError as e:  # what that schedule's own dry run would refuse with
                    why.append(str(e))
                    continue
                if (name, other.pipeline.counts) != (here.schedule, here.counts):
                    rows.append(row(name, other))
                break
            else:
                refused.append(f"{name}: " + "; with the schedule's own stage count: ".join(why))
    finally:
        logging.disable(level)
    unit_name = "" if unit == "s" else " (units)"
    limit = (f", no split over the memory limit of {p.pipeline_parallel_memory_limit_gib:g} GiB"
             if p.pipeline_parallel_memory_limit_gib else "")
    layers = (f", pipeline_parallel_layers_per_stage {p.pipeline_parallel_layers_per_stage} where the schedule"
              " allows it" if p.pipeline_parallel_layers_per_stage else "")
    lines = [f"Schedules compared (--compare-schedules): each planned as its own job with split_mode makespan, the"
             f" same part costs and {plan.n_microbatches} microbatches{layers}{limit}; fastest first"]
    lines += _table(["schedule", "stages", f"predicted step{unit_name}", "vs this plan", "most idle rank",
                     "most memory GiB"], [r for _, r in sorted(rows, key=lambda r: r[0])])
    lines += [f"Cannot run here: {line}" for line in refused]
    return lines


def predicted_step(plan: JobPlan) -> list[str]:
    """Per pp rank compute, idle time and bubble of the planned split in the schedule's simulated step,
    how the split was chosen, and the next-best splits with their predicted cost."""
    pipeline, costs, p = plan.pipeline, plan.pipeline_costs, plan.config.parallelism
    sim = _simulator(plan)
    chosen = sim.predict(pipeline.counts)
    unit = costs.unit
    units = "seconds" if unit == "s" else "units (1 = the mean block's forward of one microbatch)"
    fitted = " (fitted to the measured step)" if costs.measured_counts else ""
    comm = (f"each transfer between ranks {costs.send * 1e3:.3f} ms{fitted}" if costs.send else
            "transfers not modelled (set pipeline_parallel_device_tflops to predict seconds with transfers)")
    lines = [f"Predicted step: {pipeline.schedule} replayed with each stage's F/B/I/W costs from the {costs.source},"
             f" in {units}; {comm}"]
    rows = [[str(r), ", ".join(map(str, sim.stage_ids[r])), _amount(chosen.busy[r], unit),
             _amount(chosen.makespan - chosen.busy[r], unit), f"{100 * chosen.bubble(r):.1f}%"]
            for r in range(pipeline.pp)]
    lines += _table(["pp rank", "stages", "compute", "idle", "bubble"], rows)
    if costs.source.startswith("FLOP model"):
        memory = ("the loss and the embedding's gradient by their bytes at the memory bandwidth" if "memory at"
                  in costs.source else "the loss and the embedding's gradient at nothing (with a throughput, set"
                  " pipeline_parallel_device_memory_gbytes_per_second to price their bytes)")
        lines.append(f"(the FLOP model prices every matmul at one throughput and {memory}; measured costs:"
                     " python -m trainer.measure_costs on one device, or a timed pipeline run,"
                     " then --parallelism.pipeline_parallel_cost_file)")
        blocks = costs.parts["F"][1:-1]  # in relative units their mean is 1: only seconds can fall under the line
        if blocks and (block := sum(blocks) / len(blocks)) < LAUNCH_BOUND_BLOCK_S:
            lines.append(f"(a block's forward is priced at {block * 1e6:,.1f} us at this throughput: under"
                         f" {LAUNCH_BOUND_BLOCK_S * 1e3:g} ms a block's kernels take longer to launch, one at a time,"
                         " than to run, which FLOPs do not count, so these times and this split can be far off;"
                         " time the parts with python -m trainer.measure_costs)")
    else:
        unused = [k for k, v in (("pipeline_parallel_device_tflops", p.pipeline_parallel_device_tflops),
                                 ("pipeline_parallel_device_memory_gbytes_per_second",
                                  p.pipeline_parallel_device_memory_gbytes_per_second)) if v]
        if unused:
            lines.append(f"({' and '.join(unused)} set but unused: the measured costs are already seconds)")
    lines.append(f"step (makespan): {_amount(chosen.makespan, unit)}{'' if unit == 's' else ' units'}")
    search = pipeline.search or search_splits(sim)
    seen = f"{search.evaluated:,} of {search.total:,} splits"
    every = search.exact and search.evaluated >= search.total
    how = (f"exact: all {search.total:,} contiguous splits simulated" if every else
           f"exact: {seen} simulated, the rest ruled out by branch and bound" if search.exact else
           f"{seen} simulated before the search's budget ran out, not proven the best")
    layers = plan.spec.layers_attr
    if pipeline.search is not None:
        lines.append(f"Split chosen by the planner (split_mode makespan; {how})"
                     + (f"; {search.refused_for_memory} splits refused for the memory limit"
                        if search.refused_for_memory else ""))
    else:
        best = search.best[0]
        why = ("given split points" if p.pipeline_parallel_split_points
               else f"split_mode {p.pipeline_parallel_split_mode}")
        slower = chosen.makespan / best.makespan - 1
        lines.append(f"Split from {why}: predicted {100 * slower:.1f}% slower than the planner's choice"
                     f" {_points(best.counts, layers)} ({_amount(best.makespan, unit)}; {how})"
                     if slower > 1e-9 else f"Split from {why}: as fast as the planner's choice ({how})")
    if costs.measured_counts and len(costs.measured_counts) == pipeline.num_stages:
        run = sim.predict(costs.measured_counts)
        lines.append(f"Measured run's split {_points(run.counts, layers)}:"
                     f" {_amount(run.makespan, unit)} predicted with its"
                     f" own measurements; this plan's split {100 * (1 - chosen.makespan / run.makespan):.1f}% shorter")
    others = [c for c in search.best if c.counts != pipeline.counts][:3]
    if others:
        lines.append("Next best: " + "; ".join(f"{_points(c.counts, layers)} {_amount(c.makespan, unit)}"
                                               f" ({_signed_percent(c.makespan / chosen.makespan - 1)})"
                                               for c in others))
    return lines


def _signed_percent(fraction: float) -> str:
    """``fraction`` as a signed percentage with one decimal; a tie within rounding prints +0.0%, not -0.0%."""
    percent = 100 * fraction
    return f"{0.0 if abs(percent) < 0.05 else percent:+.1f}%"


def _points(counts: tuple[int, ...], layers_attr: str) -> str:
    starts = [sum(counts[:i]) for i in range(1, len(counts))]
    return "[" + ", ".join(f"{layers_attr}.{s}" for s in starts) + "]"
