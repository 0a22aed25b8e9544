"""The dry run: the job plan as text, before any device is spent. No process group needed.

``python train.py --job.config_file configs/llama3_8b.toml --dry-run --world-size 64``
"""

from pathlib import Path

import torch

from trainer.activation_memory import activation_peaks
from trainer.parallel.mesh import DIM_NAMES, EP_DIM_NAMES
from trainer.parallel.schedule_sim import timeline
from trainer.plan import JobPlan

DEVICE = "cuda"  # the dry run plans for the job's accelerators: mixed_precision_param "auto" means bf16


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


def _data_line(config) -> str:
    t = config.training
    opts = t.dataloader
    if t.dataset_mix:
        source = "mix " + ", ".join(f"{name} x{weight:g}" for name, weight in t.dataset_mix.items())
    else:
        source = t.dataset_path or t.dataset
    streamed = not t.dataset_mix and not t.dataset_path and t.dataset != "python_docs" and opts.streaming
    how = ("streamed: every rank tokenizes the global batch" if streamed else
           f"token shards, each rank reads its windows of {t.seq_len + 1} tokens"
           f"{', shuffled' if opts.shuffle else ''}{', read ahead' if opts.prefetch else ''}")
    return f"Data: {source} (split {opts.split!r}); {how}"


def describe_plan(plan: JobPlan) -> str:
    """The plan as text; also writes the schedule timeline into the dump folder when pipelined."""
    config, dims, spec = plan.config, plan.dims, plan.spec
    t, p = config.training, config.parallelism
    shard = plan.param_split  # ways each parameter is split in memory
    lines = [
        f"Plan: {config.job.description}",
        f"Model: {config.model.name} {config.model.flavor}, {plan.num_params / 1e6:,.2f}M parameters,"
        f" {plan.flops_per_token / 1e9:.2f} GFLOP/token (training), seq_len {t.seq_len}",
        f"World: {dims.describe()}",
        "Mesh: (" + ", ".join(f"{n}={getattr(dims, n)}" for n in (EP_DIM_NAMES if dims.ep > 1 else DIM_NAMES))
        + ")"
        + (" with dp_shard = dp_shard_mod_ep x ep; experts sharded over ep" if dims.ep > 1 else ""),
        f"Batch: global {plan.global_batch_size} sequences = local {t.local_batch_size}"
        f" x data-parallel {dims.dp} x accumulation {plan.accum_steps}",
        _data_line(config),
        f"Metrics reported by rank {plan.reporting_rank}",
    ]
    if config.validation.enable:
        v = config.validation
        what = "the whole set" if v.steps == -1 else f"{v.steps} global batches"
        lines.append(f"Validation: {v.dataset_path or v.dataset} split {v.split!r}, {what} every {v.freq} steps"
                     " and after the last, forward only")
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
    activations = activation_peaks(plan, DEVICE)
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
            lines.append(f"Activations: ~{activations[0] / 2**30:.2f} GiB per device (microbatch of"
                         f" {config.training.local_batch_size} x {plan.tokens_per_rank} tokens); total"
                         f" ~{plan.state_gib_per_device(0) + activations[0] / 2**30:.1f} GiB")
        lines.append(f"({act_note})")
        return "\n".join(lines) + "\n"

    bubble = plan.bubble()
    if bubble is None:
        bubble_text = f"from {p.pipeline_parallel_schedule_csv} (not simulated)"
    else:
        bubble_text = f"expected bubble {100 * bubble:.1f}% (compute F=1, B=2, I=W=1; communication not modelled)"
    lines += [
        f"Pipeline: {pipeline.schedule}, {pipeline.num_stages} stages, {pipeline.stages_per_rank} per rank,"
        f" {'V' if pipeline.style == 'v' else 'loop'} placement, {plan.n_microbatches} microbatches of"
        f" {p.pipeline_parallel_microbatch_size} per step; {bubble_text}",
        f"Split points: {pipeline.split_points(spec.layers_attr)}",
        ("Front-end: tracer (torch.distributed.pipelining.pipeline traces the whole model on CPU once per rank"
         " and cuts the graph before each split point; stages run torch's traced stages)" if plan.traced else
         "Front-end: manual (each stage builds the model class without the other stages' modules)"),
        "",
    ]
    rows = [
        [str(stage.index), str(pipeline.rank_of_stage(stage.index)), _stage_modules(plan, stage),
         f"{plan.stage_params[stage.index] / 1e6:,.1f}M", f"{plan.stage_flops[stage.index] / 1e9:.2f}"]
        for stage in pipeline.stages
    ]
    lines += _table(["stage", "pp rank", "modules", "parameters", "fwd GFLOP/token"], rows)
    lines.append("")
    known = not isinstance(activations, str)
    mem_rows = [
        [str(r), ", ".join(str(s) for s in pipeline.stage_ids(r)), f"{plan.rank_params(r) / 1e6:,.1f}M",
         f"{plan.state_gib_per_device(r):.2f}",
         f"{activations[r] / 2**30:.2f}" if known else "-",
         f"{plan.state_gib_per_device(r) + activations[r] / 2**30:.2f}" if known else "-"]
        for r in range(pipeline.pp)
    ]
    lines += _table(["pp rank", "stages", "parameters", "state GiB", "activations GiB", "total GiB"], mem_rows)
    lines.append(
        f"(state: fp32 parameters, gradients and Adam state per device, split {shard} ways by FSDP x CP x TP;"
        f" {act_note})"
    )
    if bubble is not None:
        dump = Path(config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        path = dump / "pipeline_schedule.txt"
        path.write_text(timeline(pipeline.schedule, pipeline.pp, plan.n_microbatches, pipeline.stages_per_rank))
        lines.append(f"Schedule timeline (action order per rank): {path}")
    return "\n".join(lines) + "\n"
