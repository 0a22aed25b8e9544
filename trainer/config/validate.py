"""Checks that need nothing but the config: run when it is loaded, before anything is built.

Checks that need the model, the world size or torch (parallel degrees, split points, TP plans,
schedule constraints) happen while the job plan is built (``trainer.plan.build_job_plan``).
"""

from pathlib import Path

from trainer.config.schedules import SCHEDULES
from trainer.config.schema import CHECKPOINT_PARTS, JobConfig, LRScheduler, Training
from trainer.errors import ConfigError


def validate_config(config: JobConfig) -> None:
    """Raise ConfigError naming the key to change."""
    _check_lr_schedule(config)
    _check_parallelism(config)
    _check_checkpoint(config)
    _check_activation_checkpoint(config)
    _check_files(config)


def decay_steps(lr_scheduler: LRScheduler, steps: int) -> int:
    """Number of steps in the decay phase of the LR schedule (``lr_scheduler`` is that section)."""
    if lr_scheduler.decay_ratio is None:
        return steps - lr_scheduler.warmup_steps
    return round(lr_scheduler.decay_ratio * steps)


def _check_lr_schedule(config: JobConfig) -> None:
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
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp > 1 and t.seq_len % (2 * cp):
        raise ConfigError(
            f"[training] seq_len={t.seq_len} must be divisible by 2 * [parallelism] context_parallel_degree={cp}"
            f" (each sequence is cut into {2 * cp} equal chunks, two per context-parallel rank)"
        )
    if tp > 1 and p.enable_sequence_parallel and (t.seq_len // cp) % tp:
        per_rank = f" / context_parallel_degree {cp} = {t.seq_len // cp} tokens per rank," if cp > 1 else ""
        raise ConfigError(
            f"[training] seq_len={t.seq_len}{per_rank} must be divisible by [parallelism] tensor_parallel_degree="
            f"{tp} for sequence parallelism (or set enable_sequence_parallel = false)"
        )
    if p.tensor_parallel_overrides and p.tensor_parallel_plan != "auto":
        raise ConfigError("[parallelism.tensor_parallel_overrides] apply to tensor_parallel_plan = \"auto\" only")
    if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size} must divide"
            f" [training] local_batch_size={t.local_batch_size}"
        )
    if t.global_batch_size != -1 and p.data_parallel_shard_degree != -1:
        # The data-parallel degree is known without the world size: check the batch arithmetic now.
        check_batch(t, p.data_parallel_replicate_degree * p.data_parallel_shard_degree)


def check_batch(training: Training, dp: int) -> None:
    """global_batch_size must be a whole number of local batches over the data-parallel ranks."""
    if training.global_batch_size == -1:
        return
    per_step = training.local_batch_size * dp
    if training.global_batch_size % per_step != 0:
        raise ConfigError(
            f"[training] global_batch_size={training.global_batch_size} must be a multiple of local_batch_size"
            f" {training.local_batch_size} * data-parallel degree {dp} = {per_step}"
        )


def _check_checkpoint(config: JobConfig) -> None:
    for name in config.checkpoint.exclude_from_loading:
        if name == "lr_scheduler":
            raise ConfigError(
                "[checkpoint] exclude_from_loading: 'lr_scheduler' is not a separate part: the LR schedule follows the"
                " step counter; exclude 'train_state' to restart both"
            )
        if name not in CHECKPOINT_PARTS:
            raise ConfigError(
                f"[checkpoint] exclude_from_loading: unknown part {name!r} (parts: {', '.join(CHECKPOINT_PARTS)})"
            )


def _check_activation_checkpoint(config: JobConfig) -> None:
    ac, p = config.activation_checkpoint, config.parallelism
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option: got {option!r}, expected 'op' or a positive integer"
        )
    schedule = p.pipeline_parallel_schedule
    split = p.pipeline_parallel_degree > 1 and not p.pipeline_parallel_schedule_csv and SCHEDULES[schedule].split_backward
    if split and ac.mode == "selective" and option == "op":
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option='op' cannot be used with [parallelism]"
            f" pipeline_parallel_schedule={schedule}: zero-bubble schedules run backward in two passes and"
            " per-op selective checkpointing allows one; use mode = full, or selective_ac_option = an integer"
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
