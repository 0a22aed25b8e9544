"""The training entry point: ``main(config)`` builds everything from a JobConfig and trains.

``main`` is callable in-process (tests do) and returns the per-step losses and grad norms.
"""

import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.checkpoint import Checkpointer
from trainer.config import JobConfig, to_toml, validate_config
from trainer.data import PackedBatchLoader, build_tokenizer, load_documents
from trainer.env import init_determinism, init_device, init_logging
from trainer.errors import TrainingDiverged
from trainer.loss import count_label_tokens
from trainer.metrics import MetricsLogger, StepStats
from trainer.model_parts import ModelParts, build_model, build_model_parts
from trainer.models import get_model_spec
from trainer.optim import ChunkOptimizers
from trainer.parallel.clip import clip_grad_norm_
from trainer.parallel.mesh import Meshes, all_reduce_sum, build_meshes, init_distributed, set_train_timeout
from trainer.parallel.pipeline import run_schedule
from trainer.parallel.pipeline_split import V_SCHEDULES

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """Per-step values of a finished run (as seen by the reporting rank)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, data loading included


def grad_accum_steps(training, dp: int) -> int:
    """Microbatches per optimizer step on one data-parallel rank."""
    if training.global_batch_size == -1:
        return 1
    return training.global_batch_size // (training.local_batch_size * dp)


def compute_dtype(training, device: torch.device) -> torch.dtype:
    if training.mixed_precision_param == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[training.mixed_precision_param]


class StepObserver(Protocol):
    """Sees the model between backward and update; tests use it to compare gradients per tensor."""

    def on_grads(self, step: int, parts: ModelParts) -> None:
        """Called on every rank after the step's gradients are final (tied copies summed), before clipping."""

    def on_end(self, parts: ModelParts) -> None:
        """Called on every rank after the last step's update."""


def train_step(
    parts: ModelParts, optimizers: ChunkOptimizers, microbatches, *, max_norm: float, autocast, loss_context,
    meshes: Meshes, on_grads: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over the step's microbatches, clip, update. Returns (global loss, grad norm)."""
    # Token-mean over the global batch: every microbatch's summed loss is divided by the label
    # tokens of the whole step on all data-parallel ranks, so accumulated gradients equal those
    # of one big batch. FSDP/DDP average gradients over the dp ranks; scaling by dp makes that
    # average the sum the token-mean needs. Pipeline schedules run with scale_grads=False.
    num_tokens = count_label_tokens(microbatches).float()
    all_reduce_sum(num_tokens, meshes.dp_groups())
    parts.loss.scale = meshes.dims.dp / num_tokens
    scaled: list[torch.Tensor] = []  # per-microbatch losses, each times dp / num_tokens
    for inputs, labels in microbatches:
        with loss_context():
            if parts.schedule is None:
                with autocast():
                    logits = parts.chunks[0](inputs)
                loss = parts.loss(logits, labels)
                loss.backward()
                scaled.append(loss)
            else:
                scaled += run_schedule(parts.schedule, inputs, labels, has_first=parts.has_first,
                                       has_last=parts.has_last)
    parts.sync_tied_grads()
    if on_grads is not None:
        on_grads()
    pp_group = meshes.pp.get_group() if meshes.pp is not None else None
    grad_norm = clip_grad_norm_(parts.chunks.parameters(), max_norm, pp_group=pp_group,
                                not_in_norm=parts.tied_duplicates())
    optimizers.step()
    optimizers.zero_grad()
    # This rank's share of the global token-mean; only ranks holding the last stage have one,
    # so summing over dp and pp gives every rank the global loss.
    total = torch.zeros((), device=num_tokens.device)
    for loss in scaled:
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach() / meshes.dims.dp
    all_reduce_sum(total, meshes.dp_groups() + ([pp_group] if pp_group is not None else []))
    return total, grad_norm


def reporting_rank(config: JobConfig, dims) -> int:
    """The rank that logs metrics: data/tensor-parallel rank 0 of the pipeline rank holding the last stage."""
    if dims.pp == 1:
        return 0
    v_style = config.parallelism.pipeline_parallel_schedule.lower() in {s.lower() for s in V_SCHEDULES}
    last_pp_rank = 0 if v_style and not config.parallelism.pipeline_parallel_schedule_csv else dims.pp - 1
    return last_pp_rank * (dims.world_size // dims.pp)  # pp is the outermost mesh dim


def main(config: JobConfig, *, observer: StepObserver | None = None) -> TrainResult:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dims = validate_config(config, world_size)  # every rank checks, before any collective
    # Metrics are global after the all-reduce; one rank reports them, the others log warnings
    # and errors only, so the console shows one copy without choosing LOG_RANK.
    reporting = rank == reporting_rank(config, dims)
    init_logging(logging.INFO if reporting else logging.WARNING)
    device = init_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world_size > 1:
        init_distributed(device, config.comm.init_timeout_seconds)
    try:
        return _train(config, dims, device, reporting, observer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(config: JobConfig, dims, device: torch.device, reporting: bool, observer: StepObserver | None) -> TrainResult:
    meshes = build_meshes(dims, device.type)
    init_determinism(config.debug.seed, config.debug.deterministic)
    logger.info("job: %s | %s", config.job.description, dims.describe())

    spec = get_model_spec(config.model.name)
    whole = build_model(config, spec)
    num_params = sum(p.numel() for p in whole.parameters())
    flops_per_token = spec.flops_per_token(whole.args, config.training.seq_len)
    logger.info(
        "model %s %s: %.2fM parameters, %.3g training FLOPs/token",
        config.model.name, config.model.flavor, num_params / 1e6, flops_per_token,
    )
    tokenizer = build_tokenizer(config.model, whole.args.vocab_size)
    del whole
    loader = PackedBatchLoader(
        load_documents(config.training),
        tokenizer,
        text_column=config.training.dataloader.text_column,
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
        accum_steps=grad_accum_steps(config.training, dims.dp),
        dp_rank=meshes.dp_rank,
        dp_degree=dims.dp,
    )

    dtype = compute_dtype(config.training, device)
    parts = build_model_parts(config, spec, meshes, device, dtype)
    optimizers = ChunkOptimizers(list(parts.chunks), config.optimizer, config.lr_scheduler, config.training.steps)
    # FSDP casts parameters itself; without it, autocast does the mixed precision.
    if dtype == torch.float32 or meshes.fsdp is not None:
        autocast = contextlib.nullcontext
    else:
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
    if meshes.tp is not None and not config.parallelism.disable_loss_parallel:
        loss_context = loss_parallel
    else:
        loss_context = contextlib.nullcontext

    dump = Path(config.job.dump_folder)
    config_toml = to_toml(config)
    if reporting:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(config_toml)
    metrics = MetricsLogger(
        config.metrics,
        dump_folder=config.job.dump_folder,
        enabled=reporting,
        device=device,
        flops_per_token=flops_per_token,
        dp_degree=dims.dp,
        world_size=dims.world_size,
        config_toml=config_toml,
    )
    per_pp_rank = dims.world_size // dims.pp
    checkpointer = Checkpointer(
        config.checkpoint, dump_folder=config.job.dump_folder, chunks=parts.chunks, optimizers=optimizers,
        loader=loader, spec=spec, model_args=parts.chunks[0].args,
        pp_rank=dist.get_rank() // per_pp_rank if dist.is_initialized() else 0, pp=dims.pp,
        hf_writer=not dist.is_initialized() or dist.get_rank() % per_pp_rank == 0,  # pp is the outermost dim
    )
    start_step = checkpointer.load()
    result = TrainResult()
    gc.disable()  # collected every gc_freq steps instead, so pauses happen at known points
    try:
        last_step = min(config.training.steps, config.training.stop_at_step or config.training.steps)
        for step in range(start_step + 1, last_step + 1):
            if step % config.training.gc_freq == 0:
                gc.collect(1)
            lr = optimizers.lr
            start = time.perf_counter()
            microbatches = [(x.to(device), y.to(device)) for x, y in loader.next_step()]
            loss, grad_norm = train_step(
                parts, optimizers, microbatches, max_norm=config.training.max_norm, autocast=autocast,
                loss_context=loss_context, meshes=meshes,
                on_grads=None if observer is None else (lambda: observer.on_grads(step, parts)),  # noqa: B023
            )
            optimizers.lr_step()
            loss_value, norm_value = loss.item(), grad_norm.item()  # .item() waits for the device
            result.step_times.append(time.perf_counter() - start)
            if not math.isfinite(loss_value):  # the loss is all-reduced: every rank stops here
                raise TrainingDiverged(
                    f"loss is {loss_value} at step {step}; lower [optimizer] lr or [training] max_norm"
                )
            if step == start_step + 1 and dims.world_size > 1:
                set_train_timeout(config.comm.train_timeout_seconds)
            result.losses.append(loss_value)
            result.grad_norms.append(norm_value)
            result.lrs.append(lr)
            tokens = sum(x.numel() for x, _ in microbatches)
            metrics.log(StepStats(step, loss_value, norm_value, lr), tokens)
            checkpointer.maybe_save(step, last=step == last_step, final=step == config.training.steps)
        checkpointer.wait()
        if observer is not None:
            observer.on_end(parts)
    finally:
        gc.enable()
        metrics.close()
    logger.info("training %s after step %d", "finished" if last_step == config.training.steps else "stopped", last_step)
    return result
