"""Cross-field checks of a JobConfig, run before anything expensive happens.

``validate_config(config)`` runs at load time (no process group needed). Called again with
the world size, it also resolves the parallel degrees; every rank runs the same checks on
the same inputs, so on a bad config every rank fails with the same message and none hangs.
"""

import logging
from pathlib import Path

from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)
_WARNED: set = set()  # warnings already given (the config is validated at load and again at start)


def validate_config(config: JobConfig, world_size: int | None = None) -> ParallelDims | None:
    """Raise ConfigError naming the key to change; returns the resolved ParallelDims if world_size is given."""
    _check_schedule(config)
    _check_parallelism(config)
    _check_files(config)
    _check_model(config)
    _check_supported(config)
    dims = None
    if world_size is not None:
        dims = ParallelDims.from_config(config.parallelism, world_size)
        _check_batch(config, dims.dp)
    else:
        p = config.parallelism
        if p.data_parallel_shard_degree != -1:
            _check_batch(config, p.data_parallel_replicate_degree * p.data_parallel_shard_degree)
    return dims


def _check_batch(config: JobConfig, dp: int) -> None:
    t = config.training
    if t.global_batch_size == -1:
        return
    per_step = t.local_batch_size * dp
    if t.global_batch_size % per_step != 0:
        raise ConfigError(
            f"[training] global_batch_size={t.global_batch_size} must be a multiple of local_batch_size"
            f" {t.local_batch_size} * data-parallel degree {dp} = {per_step}"
        )


def decay_steps(lr_scheduler, steps: int) -> int:
    """Number of steps in the decay phase of the LR schedule."""
    if lr_scheduler.decay_ratio is None:
        return steps - lr_scheduler.warmup_steps
    return round(lr_scheduler.decay_ratio * steps)


def _check_schedule(config: JobConfig) -> None:
    lr, steps = config.lr_scheduler, config.training.steps
    if lr.warmup_steps > steps:
        raise ConfigError(f"[lr_scheduler] warmup_steps={lr.warmup_steps} exceeds [training] steps={steps}")
    decay = decay_steps(lr, steps)
    if lr.warmup_steps + decay > steps:
        raise ConfigError(
            f"[lr_scheduler] warmup_steps {lr.warmup_steps} + decay steps {decay} (decay_ratio {lr.decay_ratio}"
            f" * steps {steps}) exceed [training] steps={steps}; lower decay_ratio or warmup_steps"
        )


def _check_parallelism(config: JobConfig) -> None:
    p, t = config.parallelism, config.training
    if p.tensor_parallel_degree > 1 and p.enable_sequence_parallel and t.seq_len % p.tensor_parallel_degree:
        raise ConfigError(
            f"[training] seq_len={t.seq_len} must be divisible by [parallelism] tensor_parallel_degree="
            f"{p.tensor_parallel_degree} for sequence parallelism (or set enable_sequence_parallel = false)"
        )
    if p.context_parallel_degree > 1 and t.seq_len % (2 * p.context_parallel_degree):
        raise ConfigError(
            f"[training] seq_len={t.seq_len} must be divisible by 2 * [parallelism] context_parallel_degree="
            f"{p.context_parallel_degree}"
        )
    if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size} must divide"
            f" [training] local_batch_size={t.local_batch_size}"
        )
    from trainer.checkpoint import PARTS

    for name in config.checkpoint.exclude_from_loading:
        if name == "lr_scheduler":
            raise ConfigError(
                "[checkpoint] exclude_from_loading: 'lr_scheduler' is not a separate part: the LR schedule follows the"
                " step counter; exclude 'train_state' to restart both"
            )
        if name not in PARTS:
            raise ConfigError(f"[checkpoint] exclude_from_loading: unknown part {name!r} (parts: {', '.join(PARTS)})")
    ac = config.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option: got {option!r}, expected 'op' or a positive integer"
        )


def _check_files(config: JobConfig) -> None:
    for key, path in (
        ("[training] dataset_path", config.training.dataset_path),
        ("[model] tokenizer_path", config.model.tokenizer_path),
        ("[parallelism] pipeline_parallel_schedule_csv", config.parallelism.pipeline_parallel_schedule_csv),
        ("[checkpoint] initial_load_path", config.checkpoint.initial_load_path),
    ):
        if path and not Path(path).exists():
            raise ConfigError(f"{key}: file not found: {path}")


def _check_model(config: JobConfig) -> None:
    from trainer.models import get_model_spec, import_model_modules, resolve_model_args

    import_model_modules(config.model.modules)
    spec = get_model_spec(config.model.name)
    args = resolve_model_args(spec, config.model)
    if config.parallelism.pipeline_parallel_degree > 1:
        _check_pipeline(config, spec)
    if config.parallelism.tensor_parallel_degree > 1:
        from trainer.model_parts import build_model
        from trainer.parallel.parallelize import resolve_tp_plan

        # Builds (or derives) the plan on a meta model: unshardable sizes fail here, not at launch.
        resolve_tp_plan(spec, build_model(config, spec), config.parallelism, seq_len=config.training.seq_len)
    tp = config.parallelism.tensor_parallel_degree
    heads = {"n_heads": getattr(args, "n_heads", None), "n_kv_heads": getattr(args, "num_kv_heads", None)}
    for field, count in heads.items():
        if tp > 1 and count is not None and count % tp:
            raise ConfigError(
                f"[parallelism] tensor_parallel_degree={tp} must divide model {field}={count}"
                f" ({config.model.name} {config.model.flavor})"
            )


# Keys that exist in the schema (so configs written for later versions parse) but whose feature
# has not landed yet. Each raises rather than being silently ignored.
def _check_supported(config: JobConfig) -> None:
    p = config.parallelism
    unsupported = [
        (p.context_parallel_degree > 1, "[parallelism] context_parallel_degree > 1"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"{what}: not supported by this version of the trainer yet")


def _check_pipeline(config: JobConfig, spec) -> None:
    """Split points, stage counts and the schedule's own rules, on a meta-device model."""
    from trainer.model_parts import build_model, pipeline_plan
    from trainer.parallel.pipeline_split import V_SCHEDULES
    from trainer.parallel.schedule_sim import check_csv, check_schedule

    p = config.parallelism
    plan = pipeline_plan(config, spec, build_model(config, spec))
    n_micro = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    zero_bubble = plan.schedule in ("InterleavedZeroBubble",) + V_SCHEDULES
    ac = config.activation_checkpoint
    if zero_bubble and ac.mode == "selective" and ac.selective_ac_option == "op":
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option='op' cannot be used with [parallelism]"
            f" pipeline_parallel_schedule={plan.schedule}: zero-bubble schedules run backward in two passes and"
            " per-op selective checkpointing allows one; use mode = full, or selective_ac_option = an integer"
        )
    if plan.schedule == "csv":
        check_csv(p.pipeline_parallel_schedule_csv, plan.pp, plan.num_stages, n_micro)
    else:
        check_schedule(plan.schedule, plan.pp, n_micro, plan.stages_per_rank)
    if n_micro < plan.num_stages and (n_micro, plan.num_stages) not in _WARNED:
        _WARNED.add((n_micro, plan.num_stages))
        logger.warning(
            "[parallelism] %d microbatches for %d stages: the pipeline never fills (expected bubble %.0f%%);"
            " raise [training] local_batch_size or lower pipeline_parallel_microbatch_size",
            n_micro, plan.num_stages, 100 * bubble_fraction_or_nan(plan, n_micro),
        )


def bubble_fraction_or_nan(plan, n_micro: int) -> float:
    from trainer.parallel.schedule_sim import bubble_fraction

    if plan.schedule == "csv":
        return float("nan")
    return bubble_fraction(plan.schedule, plan.pp, n_micro, plan.stages_per_rank)
