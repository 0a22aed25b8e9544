"""The training entry point: ``main(config)`` builds everything from a JobConfig and trains.

``main`` is callable in-process (tests do) and returns the per-step losses and grad norms.
"""

import contextlib
import dataclasses
import gc
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.config import JobConfig, to_toml, validate_config
from trainer.data import PackedBatchLoader, build_tokenizer, load_documents
from trainer.env import init_determinism, init_device, init_logging
from trainer.errors import TrainingDiverged, UserError
from trainer.loss import count_label_tokens, cross_entropy_sum
from trainer.metrics import MetricsLogger, StepStats
from trainer.models import get_model_spec, resolve_model_args
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel.clip import clip_grad_norm_

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


def build_model(config: JobConfig, device: torch.device) -> torch.nn.Module:
    """The model of ``[model]`` on the meta device, with its rotary table sized to seq_len."""
    spec = get_model_spec(config.model.name)
    args = resolve_model_args(spec, config.model)
    if hasattr(args, "max_seq_len"):
        args = dataclasses.replace(args, max_seq_len=config.training.seq_len)
    with torch.device("meta"):
        return spec.model_cls(args)


def train_step(model, optimizer, microbatches, *, max_norm: float, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over the step's microbatches, clip, update. Returns (loss, grad norm)."""
    # Token-mean over the global batch: each microbatch's summed loss is divided by the label
    # tokens of the whole step, so accumulated gradients equal those of one big batch.
    num_tokens = count_label_tokens(microbatches)
    total = torch.zeros((), dtype=torch.float32)
    for inputs, labels in microbatches:
        with autocast():
            logits = model(inputs)
        loss = cross_entropy_sum(logits, labels) / num_tokens
        loss.backward()
        total += loss.detach().cpu()
    grad_norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


def main(config: JobConfig) -> TrainResult:
    init_logging()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = validate_config(config, world_size)
    if world_size > 1:
        raise UserError(f"WORLD_SIZE={world_size}: multi-process training is not supported by this version yet")
    device = init_device(local_rank)
    init_determinism(config.debug.seed, config.debug.deterministic)
    logger.info("job: %s | %s", config.job.description, dims.describe())

    spec = get_model_spec(config.model.name)
    model = build_model(config, device)
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = spec.flops_per_token(model.args, config.training.seq_len)
    logger.info(
        "model %s %s: %.2fM parameters, %.3g training FLOPs/token",
        config.model.name, config.model.flavor, num_params / 1e6, flops_per_token,
    )
    tokenizer = build_tokenizer(config.model, model.args.vocab_size)
    loader = PackedBatchLoader(
        load_documents(config.training),
        tokenizer,
        text_column=config.training.dataloader.text_column,
        seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
        accum_steps=grad_accum_steps(config.training, dims.dp),
    )

    model.to_empty(device=device)
    model.init_weights(config.debug.seed)
    model.train()
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    dtype = compute_dtype(config.training, device)
    if dtype == torch.float32:
        autocast = contextlib.nullcontext
    else:
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731

    dump = Path(config.job.dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    config_toml = to_toml(config)
    (dump / "config.toml").write_text(config_toml)
    metrics = MetricsLogger(
        config.metrics,
        dump_folder=config.job.dump_folder,
        enabled=True,
        device=device,
        flops_per_token=flops_per_token,
        world_size=world_size,
        config_toml=config_toml,
    )
    result = TrainResult()
    gc.disable()  # collected every gc_freq steps instead, so pauses happen at known points
    try:
        for step in range(1, config.training.steps + 1):
            if step % config.training.gc_freq == 0:
                gc.collect(1)
            lr = scheduler.get_last_lr()[0]
            start = time.perf_counter()
            microbatches = [(x.to(device), y.to(device)) for x, y in loader.next_step()]
            loss, grad_norm = train_step(
                model, optimizer, microbatches, max_norm=config.training.max_norm, autocast=autocast
            )
            scheduler.step()
            loss_value, norm_value = loss.item(), grad_norm.item()  # .item() waits for the device
            result.step_times.append(time.perf_counter() - start)
            if not math.isfinite(loss_value):
                raise TrainingDiverged(
                    f"loss is {loss_value} at step {step}; lower [optimizer] lr or [training] max_norm"
                )
            result.losses.append(loss_value)
            result.grad_norms.append(norm_value)
            result.lrs.append(lr)
            tokens = sum(x.numel() for x, _ in microbatches)
            metrics.log(StepStats(step, loss_value, norm_value, lr), tokens)
    finally:
        gc.enable()
        metrics.close()
    logger.info("training finished after %d steps", config.training.steps)
    return result
