"""Optimizer and learning-rate schedule, built from ``[optimizer]`` and ``[lr_scheduler]``."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import schema
from trainer.config.validate import decay_steps, warmup_steps
from trainer.dtensor import is_dtensor


def build_optimizer(model: nn.Module, optimizer: schema.Optimizer) -> torch.optim.Optimizer:
    """AdamW/Adam over the model's parameters; ``optimizer`` is the ``[optimizer]`` section.

    Weight decay applies to matrices and embeddings; norms' 1-D gains are not decayed.
    """
    # Groups also split by layout: multi-tensor kernels cannot mix DTensors of different meshes, or
    # DTensors with plain tensors (e.g. layers an automatic TP plan left replicated).
    groups: dict[tuple, list] = {}
    for p in model.parameters():
        if p.requires_grad:
            mesh = p.device_mesh if is_dtensor(p) else None
            groups.setdefault((p.ndim >= 2, id(mesh)), []).append(p)
    impl = {
        "for-loop": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
    }[optimizer.implementation]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[optimizer.name]
    return cls(
        [{"params": ps, "weight_decay": optimizer.weight_decay if decay else 0.0} for (decay, _), ps in groups.items()],
        lr=optimizer.lr,
        betas=(optimizer.beta1, optimizer.beta2),
        eps=optimizer.eps,
        **impl,
    )


def lr_factor(step: int, lr_scheduler: schema.LRScheduler, steps: int) -> float:
    """Multiplier of the peak lr used at 1-based training ``step``.

    Linear warm-up reaches 1 at step ``warmup_steps``; the last ``decay_steps`` steps decay
    to ``min_lr_factor``, reaching it exactly at the last step; in between the lr is flat.
    Never negative: beyond ``steps`` the factor stays at the floor.
    """
    warmup = warmup_steps(lr_scheduler, steps)
    if step <= warmup:
        return step / warmup
    decay = decay_steps(lr_scheduler, steps)
    decay_start = steps - decay
    if decay == 0 or step <= decay_start:
        return 1.0
    progress = min((step - decay_start) / decay, 1.0)  # in (0, 1]; past the last step the floor holds
    shape = {
        "linear": 1.0 - progress,
        "sqrt": 1.0 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[lr_scheduler.decay_type]
    floor = lr_scheduler.min_lr_factor
    return floor + (1.0 - floor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, lr_scheduler: schema.LRScheduler, steps: int) -> LambdaLR:
    """Schedule stepped once per optimizer step. LambdaLR's counter starts at 0 for step 1."""
    return LambdaLR(optimizer, lambda i: lr_factor(i + 1, lr_scheduler, steps))


class ChunkOptimizers:
    """One optimizer and LR schedule per model chunk, stepped together.

    Per chunk, so that optimizer state can be keyed by the chunk's (global) parameter names:
    checkpoints then do not depend on how the model was split.
    """

    def __init__(self, chunks: list[nn.Module], optimizer: schema.Optimizer, lr_scheduler: schema.LRScheduler,
                 steps: int):
        self.optimizers = [build_optimizer(chunk, optimizer) for chunk in chunks]
        self.schedulers = [build_lr_scheduler(o, lr_scheduler, steps) for o in self.optimizers]
        self._lr_scheduler, self._steps = lr_scheduler, steps

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def lr_step(self) -> None:
        for sched in self.schedulers:
            sched.step()

    @property
    def lr(self) -> float:
        """Learning rate the next step will use."""
        return self.schedulers[0].get_last_lr()[0]

    def set_schedule_position(self, completed_steps: int) -> None:
        """Put the LR schedules where they are after ``completed_steps`` optimizer steps."""
        factor = lr_factor(completed_steps + 1, self._lr_scheduler, self._steps)
        for opt, sched in zip(self.optimizers, self.schedulers):
            sched.last_epoch = completed_steps
            for group, base in zip(opt.param_groups, sched.base_lrs):
                group["lr"] = base * factor
            sched._last_lr = [g["lr"] for g in opt.param_groups]

    @torch.no_grad()
    def init_state(self) -> None:
        """Create Adam's state (zeros) without changing any parameter, so a checkpoint can load into it."""
        for opt in self.optimizers:
            saved = [g["lr"] for g in opt.param_groups]
            for group in opt.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for group, lr in zip(opt.param_groups, saved):
                group["lr"] = lr
