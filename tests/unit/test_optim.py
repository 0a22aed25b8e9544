"""LR schedule values and optimizer parameter groups."""

import math

import pytest
import torch

from trainer.config import load_config
from trainer.optim import build_lr_scheduler, build_optimizer, lr_factor


def sched(**kw):
    args = ["--training.steps", "10"]
    for k, v in kw.items():
        args += [f"--lr_scheduler.{k}", str(v)]
    return load_config(overrides=args).lr_scheduler


def test_warmup_then_linear_decay_to_zero():
    s = sched(warmup_steps=2)
    assert [lr_factor(i, s, 10) for i in range(1, 11)] == pytest.approx(
        [0.5, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0.0]
    )


def test_warmup_stable_decay_with_floor():
    s = sched(warmup_steps=2, decay_ratio=0.4, min_lr_factor=0.1)  # decay over the last 4 steps
    values = [lr_factor(i, s, 10) for i in range(1, 11)]
    assert values[:6] == pytest.approx([0.5, 1, 1, 1, 1, 1])
    assert values[6:] == pytest.approx([0.1 + 0.9 * (1 - p) for p in (0.25, 0.5, 0.75, 1.0)])


@pytest.mark.parametrize(
    "kind, shape",
    [("sqrt", lambda p: 1 - math.sqrt(p)), ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p)))],
)
def test_decay_shapes(kind, shape):
    s = sched(warmup_steps=0, decay_type=kind)
    assert [lr_factor(i, s, 10) for i in range(1, 11)] == pytest.approx([shape(i / 10) for i in range(1, 11)])


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(3, 3)
    config = load_config(overrides=["--training.steps", "4", "--lr_scheduler.warmup_steps", "2"])
    opt = build_optimizer(model, config.optimizer)
    sch = build_lr_scheduler(opt, config.lr_scheduler, 4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    assert seen == pytest.approx([4e-4, 8e-4, 4e-4, 0.0])


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_weight_decay_only_on_matrices(impl):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True), torch.nn.LayerNorm(4))
    config = load_config(overrides=["--optimizer.implementation", impl])
    opt = build_optimizer(model, config.optimizer)
    decayed, plain = opt.param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_clipping_norm_is_accurate_on_large_gradients():
    from trainer.parallel.clip import clip_grad_norm_

    torch.manual_seed(0)
    # One 2048 x 256 gradient (the debug model's output projection) and a few small ones.
    params = [torch.nn.Parameter(torch.zeros(2048, 256)), torch.nn.Parameter(torch.zeros(256)),
              torch.nn.Parameter(torch.zeros(64, 64))]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    params[0].grad[:100] *= 30
    exact = sum(p.grad.double().norm() ** 2 for p in params) ** 0.5
    norm = clip_grad_norm_(params, max_norm=0.0)
    # float32 rounding of the exact value; a float32 accumulation was 5.7e-5 off here
    assert norm.item() == pytest.approx(exact.item(), rel=1e-7)


def test_clipping_norm_accumulates_large_gradients_piece_by_piece(monkeypatch):
    from trainer.parallel import clip

    monkeypatch.setattr(clip, "_CPU_NORM_CHUNK", 1000)  # 3 pieces and a short one for the 2500-element gradient
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(50, 50)), torch.nn.Parameter(torch.zeros(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[-10:] *= 100  # the last, short piece carries most of the norm
    exact = sum(p.grad.double().norm() ** 2 for p in params) ** 0.5
    norm = clip.clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == pytest.approx(exact.item(), rel=1e-7)
    clipped = sum(p.grad.double().norm() ** 2 for p in params) ** 0.5
    assert clipped.item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_lr_never_goes_below_the_floor_past_the_last_step(decay_type):
    sched = load_config(overrides=["--training.steps", "10", "--lr_scheduler.decay_type", decay_type,
                                   "--lr_scheduler.min_lr_factor", "0.1"]).lr_scheduler
    assert lr_factor(10, sched, 10) == pytest.approx(0.1)
    assert [lr_factor(s, sched, 10) for s in (11, 15, 100)] == pytest.approx([0.1, 0.1, 0.1])
