"""The dry run: what would run where, before any device is spent. No process group needed.

``python train.py --job.config_file configs/llama3_8b.toml --dry-run --world-size 64``
"""

from pathlib import Path

from torch import nn

from trainer.config import JobConfig, validate_config
from trainer.model_parts import build_model, pipeline_plan
from trainer.models import get_model_spec
from trainer.parallel.auto_tp import derive_tp_plan
from trainer.parallel.mesh import DIM_NAMES
from trainer.parallel.parallelize import resolve_tp_plan
from trainer.parallel.pipeline import build_chunk
from trainer.parallel.pipeline_split import module_costs
from trainer.parallel.schedule_sim import bubble_fraction, timeline

# fp32 parameter + fp32 gradient + two fp32 Adam moments.
BYTES_PER_PARAM = 16


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _modules(chunk: nn.Module, spec) -> str:
    names = [n for n in spec.pre_layers if getattr(chunk, n, None) is not None]
    keys = list(getattr(chunk, spec.layers_attr).keys())
    if keys:
        names.append(f"{spec.layers_attr}.{keys[0]}" + (f"-{keys[-1]}" if len(keys) > 1 else ""))
    names += [n for n in spec.post_layers if getattr(chunk, n, None) is not None]
    return ", ".join(names)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*["-" * w for w in widths])] + [fmt.format(*r) for r in rows]


def _tp_lines(config: JobConfig, spec, whole: nn.Module, tp: int) -> list[str]:
    """The tensor-parallel plan, per module; with tensor_parallel_plan = auto, how it was derived."""
    p = config.parallelism
    if p.tensor_parallel_plan == "auto":
        plan = derive_tp_plan(whole, layers_attr=spec.layers_attr, pre=spec.pre_layers, post=spec.post_layers,
                              tp=tp, seq_len=config.training.seq_len, loss_parallel=not p.disable_loss_parallel,
                              overrides=p.tensor_parallel_overrides)
        return [f"Tensor parallel plan (derived automatically; block modules apply to every {spec.layers_attr}.N):"]\
            + plan.describe()
    top, block = resolve_tp_plan(spec, whole, p, seq_len=config.training.seq_len)
    return [f"Tensor parallel plan ({spec.name}'s own; block modules apply to every {spec.layers_attr}.N):"] + [
        f"  {name}: {type(style).__name__}" for name, style in {**top, **block}.items()
    ]


def describe_plan(config: JobConfig, world_size: int) -> str:
    """The plan as text; also writes the schedule timeline into the dump folder when pipelined."""
    dims = validate_config(config, world_size)
    spec = get_model_spec(config.model.name)
    whole = build_model(config, spec)
    t, p = config.training, config.parallelism
    accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dims.dp)
    shard = dims.dp_shard * dims.tp  # ways each parameter is split in memory
    lines = [
        f"Plan: {config.job.description}",
        f"Model: {config.model.name} {config.model.flavor}, {_count(whole) / 1e6:,.2f}M parameters,"
        f" {spec.flops_per_token(whole.args, t.seq_len) / 1e9:.2f} GFLOP/token (training), seq_len {t.seq_len}",
        f"World: {dims.describe()}",
        "Mesh: (" + ", ".join(f"{n}={getattr(dims, n)}" for n in DIM_NAMES) + ")",
        f"Batch: global {t.local_batch_size * dims.dp * accum} sequences = local {t.local_batch_size}"
        f" x data-parallel {dims.dp} x accumulation {accum}",
    ]
    if dims.tp > 1:
        lines += _tp_lines(config, spec, whole, dims.tp)
    if dims.pp == 1:
        params = _count(whole)
        lines.append(
            f"No pipeline: every rank runs the whole model; {params / 1e6:,.2f}M parameters,"
            f" ~{params * BYTES_PER_PARAM / shard / 2**30:.1f} GiB per device for parameters, gradients and"
            f" Adam state (split {shard} ways by FSDP x TP; activations not included)"
        )
        return "\n".join(lines) + "\n"

    plan = pipeline_plan(config, spec, whole)
    n_micro = t.local_batch_size // p.pipeline_parallel_microbatch_size
    schedule = plan.schedule
    if schedule == "csv":
        bubble_text = f"from {p.pipeline_parallel_schedule_csv} (not simulated)"
    else:
        bubble = bubble_fraction(schedule, plan.pp, n_micro, plan.stages_per_rank)
        bubble_text = f"expected bubble {100 * bubble:.1f}% (compute F=1, B=2, I=W=1; communication not modelled)"
    lines += [
        f"Pipeline: {schedule}, {plan.num_stages} stages, {plan.stages_per_rank} per rank,"
        f" {'V' if plan.style == 'v' else 'loop'} placement, {n_micro} microbatches of"
        f" {p.pipeline_parallel_microbatch_size} per step; {bubble_text}",
        f"Split points: {plan.split_points(spec.layers_attr)}",
        "",
    ]
    _, block_flops, _ = module_costs(whole, layers_attr=spec.layers_attr, pre=spec.pre_layers,
                                     post=spec.post_layers, mode="flops", seq_len=t.seq_len)
    rows, rank_params = [], [0] * plan.pp
    for stage in plan.stages:
        chunk = build_chunk(lambda: build_model(config, spec), spec, stage)
        params = _count(chunk)
        flops = module_costs(chunk, layers_attr=spec.layers_attr, pre=spec.pre_layers, post=spec.post_layers,
                             mode="flops", seq_len=t.seq_len)
        rank = plan.rank_of_stage(stage.index)
        rank_params[rank] += params
        rows.append([str(stage.index), str(rank), _modules(chunk, spec), f"{params / 1e6:,.1f}M",
                     f"{(flops[0] + sum(flops[1]) + flops[2]) / 1e9:.2f}"])
    lines += _table(["stage", "pp rank", "modules", "parameters", "fwd GFLOP/token"], rows)
    lines.append("")
    mem_rows = [
        [str(r), ", ".join(str(s) for s in plan.stage_ids(r)), f"{rank_params[r] / 1e6:,.1f}M",
         f"{rank_params[r] * BYTES_PER_PARAM / shard / 2**30:.2f}"]
        for r in range(plan.pp)
    ]
    lines += _table(["pp rank", "stages", "parameters", "GiB per device"], mem_rows)
    lines.append(
        f"(GiB per device: fp32 parameters, gradients and Adam state, split {shard} ways by FSDP x TP;"
        " activations not included)"
    )
    if schedule != "csv":
        dump = Path(config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        path = dump / "pipeline_schedule.txt"
        path.write_text(timeline(schedule, plan.pp, n_micro, plan.stages_per_rank))
        lines.append(f"Schedule timeline (action order per rank): {path}")
    return "\n".join(lines) + "\n"
