"""The training entry point: ``main(config)`` plans the job, builds this rank's share and trains.

``main`` is callable in-process (tests do) and returns the per-step losses and grad norms.
Reading order: ``main`` -> ``build_trainer`` (everything a run needs, built once) ->
``train_loop`` (the steps) -> ``run_step`` (one step: batch, ``train_step``, learning rate) -> ``train_step``
(forward/backward over the microbatches, clip, update).
"""

import contextlib
import gc
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.agreement import MEMORY_ENTRY, check_same_data, check_same_job
from trainer.checkpoint import Checkpointer, GlobalBatch, build_save_group
from trainer.config import JobConfig, to_toml
from trainer.config.render import config_fingerprint
from trainer.config.validate import data_identity, output_folders
from trainer.data.documents import model_inputs, on_device
from trainer.data import PackedBatchLoader, WindowLoader, build_eval_loader, build_tokenizer, build_train_loader
from trainer.dtensor import full_tensor, local_tensor
from trainer.env import init_determinism, init_device
from trainer.log import init_logging
from trainer.errors import TrainingDiverged, UserError
from trainer.evaluate import Evaluator
from trainer.loss import count_label_tokens
from trainer.metrics import MetricsLogger, StepStats
from trainer.model_parts import ModelParts, build_model_parts, summed_loss
from trainer.optim import ChunkOptimizers
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.mesh import Meshes, all_reduce_sum, build_meshes, init_distributed, set_train_timeout
from trainer.pipeline.runtime import run_schedule, schedule_stages, wrap_schedule_loss
from trainer.pipeline.simulate import Program, program_for
from trainer.plan import JobPlan, build_job_plan
from trainer.pipeline.cost import split_memory_limit
from trainer.profiling import PipelineTimeline, SavedActivationMeter, StepProfiler
from trainer.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """Per-step values of a finished run (as seen by the reporting rank)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, data loading included
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    pipeline_bubbles: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> pp rank -> measured bubble
    activation_peaks: dict[int, list[int]] = field(default_factory=dict)  # step -> bytes saved for backward, per rank


class StepObserver(Protocol):
    """Sees the model between backward and update; tests use it to compare gradients per tensor."""

    def on_grads(self, step: int, parts: ModelParts) -> None:
        """Called on every rank after the step's gradients are final (tied copies summed), before clipping."""

    def on_end(self, parts: ModelParts) -> None:
        """Called on every rank after the last step's update."""


@dataclass
class Trainer:
    """Everything one rank needs to run the loop, built once by ``build_trainer``."""

    plan: JobPlan
    meshes: Meshes
    device: torch.device
    parts: ModelParts
    optimizers: ChunkOptimizers
    loader: WindowLoader | PackedBatchLoader
    evaluator: Evaluator | None
    metrics: MetricsLogger
    checkpointer: Checkpointer
    autocast: Callable[[], contextlib.AbstractContextManager]
    step_context: Callable[[], contextlib.AbstractContextManager]
    """Entered around each microbatch's forward and backward: loss parallelism, context-parallel attention."""
    model_kwargs: Callable[[torch.Tensor], dict]
    """A microbatch's tokens -> the model's keyword inputs (its documents, for block-causal attention)."""
    timeline: PipelineTimeline | None = None
    profiler: StepProfiler | None = None


def train_step(
    parts: ModelParts, optimizers: ChunkOptimizers, microbatches, *, max_norm: float, autocast, step_context,
    meshes: Meshes, on_grads: Callable[[], None] | None = None, progress: Callable[[], None] = lambda: None,
    model_kwargs: Sequence[dict] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over the step's microbatches, clip, update. Returns (global loss, grad norm).

    ``progress`` is called after each microbatch (or pipeline schedule step) and each phase (the watchdog);
    ``model_kwargs[i]``: the model's keyword inputs of microbatch i (its documents; none if empty)."""
    summed: list[torch.Tensor] = []  # per-microbatch summed cross-entropy (last pipeline stage only)
    for i, (inputs, labels) in enumerate(microbatches):
        kwargs = model_kwargs[i] if model_kwargs else {}
        with step_context():
            if parts.schedule is None:
                parts.gradient_sync(i == len(microbatches) - 1)
                with autocast():
                    logits = parts.chunks[0](inputs, **kwargs)
                loss = summed_loss(logits, labels)
                loss.backward()
                summed.append(loss)
            else:
                summed += run_schedule(parts.schedule, inputs, labels, has_first=parts.has_first,
                                       has_last=parts.has_last, model_kwargs=kwargs)
        progress()
    # Token-mean over the global batch: the gradients hold the summed loss of every microbatch;
    # FSDP/DDP averaged them over the dp and cp ranks. Dividing by the label tokens of the whole
    # step on all of them (times their number, undoing the average) gives one big batch's mean.
    num_tokens = count_label_tokens(microbatches).float()
    all_reduce_sum(num_tokens, meshes.batch_groups())
    # Some weights were averaged over another number of ranks (experts: those holding the same experts).
    for average, params in parts.gradient_averages(meshes.dims.grad_average):
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, (average / num_tokens).to(grads[0].device))
    parts.sync_tied_grads()
    if on_grads is not None:
        on_grads()
    pp_group = meshes.pp.get_group() if meshes.pp is not None else None
    grad_norm = clip_grad_norm_(parts.chunks.parameters(), max_norm, pp_group=pp_group,
                                not_in_norm=parts.tied_duplicates())
    progress()
    optimizers.step()
    optimizers.zero_grad()
    parts.after_step(lambda t: all_reduce_sum(t, meshes.batch_groups()))
    # This rank's share of the global mean; only ranks holding the last stage have one, so
    # summing over dp, cp and pp gives every rank the global loss.
    total = torch.zeros((), device=num_tokens.device)
    for loss in summed:
        total += full_tensor(loss).detach()
    total /= num_tokens
    all_reduce_sum(total, meshes.batch_groups() + ([pp_group] if pp_group is not None else []))
    return total, grad_norm


def main(config: JobConfig, *, observer: StepObserver | None = None) -> TrainResult:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    plan = build_job_plan(config, world_size)  # every rank plans, before any collective
    config = plan.config  # with [model] from config.json when the run starts from a Hugging Face folder
    # Metrics are global after the all-reduce; one rank reports them, the others log warnings
    # and errors only, so the console shows one copy without choosing LOG_RANK.
    reporting = rank == plan.reporting_rank
    init_logging(logging.INFO if reporting else logging.WARNING)
    prepare_folders(config)  # every rank, before any collective: a failure is the same everywhere
    device = init_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world_size > 1:
        init_distributed(device, config.comm.init_timeout_seconds)
    try:
        # before any mesh or stage: ranks that planned another job would wait on each other, or run a part of it
        limit = split_memory_limit(config.parallelism) if plan.pipeline else None  # the configured one, or the device's
        check_same_job(config_fingerprint(config), plan.pipeline.split_points() if plan.pipeline else None, device,
                       {MEMORY_ENTRY: f"{limit / 2**30:.2f} GiB"} if limit else None)
        trainer = build_trainer(plan, device, reporting)
        return train_loop(trainer, observer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def prepare_folders(config: JobConfig) -> None:
    """Create every folder the run writes into (dump, checkpoint, TensorBoard, traces, data cache) and check
    they can be written, so a bad path fails at start with the key named instead of at the first save."""
    for key, _, folder in output_folders(config):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()  # can this rank create files there?
        except OSError as e:
            raise UserError(f"{key}: cannot write to {folder}: {e.strerror or e}") from None


def _model_context(plan: JobPlan) -> int | None:
    from trainer.hf import model_context  # only with an export: the start-up stays light otherwise

    return model_context(plan.spec, plan.config.model)


def build_trainer(plan: JobPlan, device: torch.device, reporting: bool) -> Trainer:
    """Meshes, data, model chunks, optimizers, metrics and checkpoints for this rank (restored if resuming)."""
    config, dims = plan.config, plan.dims
    meshes = build_meshes(dims, device.type)
    init_determinism(config.debug.seed, config.debug.deterministic)
    logger.info("job: %s | %s", config.job.description, dims.describe())
    logger.info("model %s %s: %.2fM parameters, %.3g training FLOPs/token",
                config.model.name, config.model.flavor, plan.num_params / 1e6, plan.flops_per_token)
    tokenizer = build_tokenizer(config.model, plan.vocab_size)
    data_args = dict(dump_folder=config.job.dump_folder, accum_steps=plan.accum_steps, dp_rank=meshes.dp_rank,
                     dp_degree=dims.dp, wait_seconds=config.comm.init_timeout_seconds)
    loader = build_train_loader(config.training, tokenizer, seed=config.debug.seed, **data_args)
    evaluator = None
    if config.validation.enable:
        eval_loader, num_batches = build_eval_loader(config.validation, config.training, tokenizer, **data_args)
        evaluator = Evaluator(eval_loader, num_batches, config.validation.freq)
    check_same_data(device, loader.fingerprint + (evaluator.loader.fingerprint if evaluator else ""))
    parts = build_model_parts(plan, meshes, device)
    optimizers = ChunkOptimizers(list(parts.chunks), config.optimizer, config.lr_scheduler, config.training.steps)
    dtype = plan.compute_dtype(device)
    # FSDP casts parameters itself; without it, autocast does the mixed precision.
    if dtype == torch.float32 or parts.casts_parameters:
        autocast = contextlib.nullcontext
    else:
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    config_toml = to_toml(config)
    if reporting:
        dump = Path(config.job.dump_folder)
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(config_toml)
    metrics = MetricsLogger(
        config.metrics, dump_folder=config.job.dump_folder, enabled=reporting, device=device,
        flops_per_token=plan.flops_per_token, dp_degree=dims.dp, world_size=dims.world_size, config_toml=config_toml,
        total_steps=min(config.training.steps, config.training.stop_at_step or config.training.steps),
    )
    pp_rank = meshes.world.get_local_rank("pp") if meshes.pp is not None else 0
    checkpointer = Checkpointer(
        config.checkpoint, dump_folder=config.job.dump_folder, chunks=parts.chunks, optimizers=optimizers,
        loader=loader, spec=plan.spec, model_args=plan.model_args, pp_rank=pp_rank, pp=dims.pp,
        hf_writer=not dist.is_initialized() or dist.get_rank() % (dims.world_size // dims.pp) == 0,
        batch=GlobalBatch(plan.global_batch_size, config.training.global_batch_size == -1, plan.global_batch_parts),
        tokenizer=tokenizer, attention=config.model.attn_mask_type,
        save_group=build_save_group(config.checkpoint, config.comm.init_timeout_seconds),
        model_context=_model_context(plan) if config.checkpoint.export_hf else None,
        data=data_identity(config.training),
    )
    timeline = None
    if config.profiling.pipeline_timeline_steps and parts.schedule is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        pipeline = plan.pipeline
        program = program_for(pipeline.schedule, pipeline.pp, plan.n_microbatches, pipeline.stages_per_rank,
                              config.parallelism.pipeline_parallel_schedule_csv)
        folder = Path(config.job.dump_folder) / config.profiling.save_traces_folder
        writer = rank == plan.reporting_rank
        timeline = PipelineTimeline(config.profiling.pipeline_timeline_steps, folder, rank=rank, pp_rank=pp_rank,
                                    writer=writer, program=program, sync=device.type == "cuda",
                                    calibration=build_calibration(plan, device, folder, program) if writer else None)
        timeline.attach(schedule_stages(parts.schedule), plan.spec.layers_attr, compiled=config.compile.enable)
        wrap_schedule_loss(parts.schedule, timeline.timed_loss)
    profiler = None
    if config.profiling.enable_profiling or config.profiling.enable_memory_snapshot:
        profiler = StepProfiler(config.profiling, config.job.dump_folder,
                                rank=dist.get_rank() if dist.is_initialized() else 0, device=device)
    return Trainer(plan, meshes, device, parts, optimizers, loader, evaluator, metrics, checkpointer, autocast,
                   parts.step_context, model_inputs(config.model.attn_mask_type, tokenizer.eos_id, tokenizer.bos_id,
                                                    always=plan.positions_always),
                   timeline, profiler)


def build_calibration(plan: JobPlan, device: torch.device, folder: Path, program: Program):
    """What a timed pipeline run of ``program`` compares its measurements with, and how it writes its cost file."""
    from trainer.pipeline.calibrate import Calibration
    from trainer.pipeline.cost import cost_identity, pipeline_costs

    pipeline = plan.pipeline
    whole = plan.build_model()
    units = pipeline_costs(plan.config, plan.spec, plan.model_args, whole, plan.dims, device.type, relative=True)
    return Calibration(
        units=units, plan_costs=plan.pipeline_costs, counts=pipeline.counts,
        program=program, path=folder / "pipeline_costs.json",
        identity=cost_identity(plan.config, sum(len(s.blocks) for s in pipeline.stages), plan.dims.tp, plan.dims.cp),
        measured={"schedule": pipeline.schedule, "pp": pipeline.pp, "device": device.type,
                  "split_points": pipeline.split_points(), "n_microbatches": plan.n_microbatches},
        layers_attr=plan.spec.layers_attr)


def report_activation_peaks(run: Trainer, step: int, peak: int) -> list[int]:
    """Every rank's measured peak of saved activations; the reporting rank logs them against the plan's estimate."""
    peaks = [peak]
    if dist.is_initialized():
        peaks = [0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
    if not dist.is_initialized() or dist.get_rank() == run.plan.reporting_rank:
        estimate = run.plan.activation_peaks(run.device.type)
        per_pp = run.plan.dims.world_size // run.plan.dims.pp  # global ranks per pipeline rank (pp is outermost)
        for pp_rank in range(run.plan.dims.pp):
            measured = max(peaks[pp_rank * per_pp:(pp_rank + 1) * per_pp])
            expected = f"estimate {estimate[pp_rank] / 2**20:,.1f} MiB" if not isinstance(estimate, str) else estimate
            if run.plan.config.activation_checkpoint.mode != "none":
                expected += "; the hooks do not see what activation checkpointing keeps"
            logger.info("step %d saved activations, pp rank %d: peak %s MiB (%s)", step, pp_rank,
                        f"{measured / 2**20:,.1f}", expected)
    return peaks


def gather_over_pipeline(values: dict[str, float], meshes: Meshes) -> dict[str, float]:
    """Per-layer metrics of every pipeline stage (each rank holds its own layers') on every rank."""
    if meshes.pp is None:
        return values
    gathered = [None] * meshes.dims.pp
    dist.all_gather_object(gathered, values, group=meshes.pp.get_group())
    return {k: v for part in gathered for k, v in part.items()}


@dataclass
class StepDone:
    """What one step of ``run_step`` left: its loss, grad norm and seconds (data loading included)."""

    loss: float
    grad_norm: float
    seconds: float
    tokens: int  # the replica's tokens this step
    bubbles: dict[int, float] | None  # measured per pp rank, on the writer, for a recorded timeline step
    activation_peaks: list[int] | None  # every rank's saved-activation peak, for a metered step


def run_step(run: Trainer, step: int, *, first: bool, observer: StepObserver | None = None,
             progress: Callable[[], None] = lambda: None) -> StepDone:
    """One training step of ``run``: load the step's batch, forward/backward, update, advance the learning rate.

    ``first``: the run's first step here (techniques that did not take effect stop every rank after it).
    The loop around it (``train_loop``) logs, evaluates and checkpoints; a benchmark may alternate the
    steps of several trainers built in one launch."""
    config = run.plan.config
    start = time.perf_counter()
    microbatches, kwargs = on_device(run.loader.next_step(), run.device, run.model_kwargs)
    if run.timeline is not None:
        run.timeline.begin_step(step)
    # this rank's part of each sequence (CP)
    microbatches, kwargs = run.parts.shard_batch(microbatches), run.parts.shard_inputs(kwargs)
    metered = step in config.profiling.activation_memory_steps
    with SavedActivationMeter(run.parts.chunks) if metered else contextlib.nullcontext() as meter:
        loss, grad_norm = train_step(
            run.parts, run.optimizers, microbatches, max_norm=config.training.max_norm, autocast=run.autocast,
            step_context=run.step_context, meshes=run.meshes,
            on_grads=None if observer is None else (lambda: observer.on_grads(step, run.parts)),
            progress=progress, model_kwargs=kwargs,
        )
    peaks = report_activation_peaks(run, step, meter.peak) if metered else None
    if first:
        run.parts.after_first_step()  # a technique that did not take effect stops every rank here
    run.optimizers.lr_step()
    loss_value, norm_value = loss.item(), grad_norm.item()  # .item() waits for the device
    seconds = time.perf_counter() - start
    bubbles = run.timeline.end_step(step) if run.timeline is not None else None
    tokens = sum(x.numel() for x, _ in microbatches) * run.plan.dims.cp  # the replica's tokens
    return StepDone(loss_value, norm_value, seconds, tokens, bubbles, peaks)


def train_loop(run: Trainer, observer: StepObserver | None = None) -> TrainResult:
    """Resume if a checkpoint exists, then train to ``[training] steps`` (or ``stop_at_step``)."""
    config = run.plan.config
    start_step = run.checkpointer.load()
    run.metrics.start(start_step)
    result = TrainResult()
    distributed = run.plan.dims.world_size > 1
    watchdog = Watchdog(config.comm.train_timeout_seconds, dist.get_rank()) if distributed else None
    if watchdog is not None:  # the first step warms up (compilation, pipeline shape inference): the init timeout
        watchdog.arm(config.comm.init_timeout_seconds, "[comm] init_timeout_seconds")
    gc.disable()  # collected every gc_freq steps instead, so pauses happen at known points
    try:
        last_step = min(config.training.steps, config.training.stop_at_step or config.training.steps)
        if start_step == config.training.steps:
            run.checkpointer.export_finished(start_step)
        for step in range(start_step + 1, last_step + 1):
            if step % config.training.gc_freq == 0:
                gc.collect(1)
            lr = run.optimizers.lr
            done = run_step(run, step, first=step == start_step + 1, observer=observer,
                            progress=watchdog.beat if watchdog is not None else (lambda: None))
            loss_value, norm_value = done.loss, done.grad_norm
            result.step_times.append(done.seconds)
            if done.activation_peaks is not None:
                result.activation_peaks[step] = done.activation_peaks
            if done.bubbles is not None:
                result.pipeline_bubbles[step] = done.bubbles
            if run.profiler is not None:
                run.profiler.step(step)
            if not math.isfinite(loss_value):  # the loss is all-reduced: every rank stops here
                raise TrainingDiverged(
                    f"loss is {loss_value} at step {step}; lower [optimizer] lr or [training] max_norm"
                )
            if step == start_step + 1 and distributed:
                set_train_timeout(config.comm.train_timeout_seconds)
                watchdog.arm(config.comm.train_timeout_seconds)
            elif watchdog is not None:
                watchdog.beat()
            result.losses.append(loss_value)
            result.grad_norms.append(norm_value)
            result.lrs.append(lr)
            run.metrics.log(StepStats(step, loss_value, norm_value, lr), done.tokens)
            if run.evaluator is not None and run.evaluator.should_run(step, last_step):
                evaluation = run.evaluator.run(
                    run.parts, run.meshes, run.device, autocast=run.autocast, step_context=run.step_context,
                    progress=watchdog.beat if watchdog is not None else (lambda: None), model_kwargs=run.model_kwargs)
                result.eval_losses[step] = evaluation.loss
                run.metrics.log_validation(step, evaluation.loss, evaluation.tokens, evaluation.seconds)
            if run.parts.after_step_hook is not None and run.metrics.should_log(step):
                run.metrics.log_model(run.plan.spec.name, gather_over_pipeline(run.parts.step_metrics, run.meshes),
                                      step)
            if run.metrics.should_log(step) and len(shares := run.loader.shares()) > 1:
                run.metrics.log_scalars("data_share", shares, step)
            with watchdog.paused() if watchdog is not None else contextlib.nullcontext():
                run.checkpointer.maybe_save(step, last=step == last_step, final=step == config.training.steps)
        with watchdog.paused() if watchdog is not None else contextlib.nullcontext():
            run.checkpointer.wait()
        if observer is not None:
            observer.on_end(run.parts)
    except KeyboardInterrupt:
        raise  # Ctrl-C ends the process at once, a save's writer thread with it: that save is never published
    except BaseException:
        with watchdog.paused() if watchdog is not None else contextlib.nullcontext():
            run.checkpointer.abandon()  # bounded by the save group's timeout
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if run.profiler is not None:
            run.profiler.stop()
        gc.enable()
        run.metrics.close()
        run.loader.close()
    logger.info("training %s after step %d", "finished" if last_step == config.training.steps else "stopped", last_step)
    return result
