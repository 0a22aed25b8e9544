"""The single-process training loop: accumulation equals one big batch, determinism, NaN stop."""

import dataclasses
import math

import pytest

import trainer.train as train_mod
from trainer.config import load_config
from trainer.errors import TrainingDiverged


def run(args, extra=()):
    return train_mod.main(load_config(overrides=list(args) + list(extra)))


def test_gradient_accumulation_equals_one_big_batch(tiny_args):
    fp32 = tiny_args + ["--training.mixed_precision_param", "float32"]  # also on CUDA, where "auto" is bf16
    big = run(fp32, ["--training.local_batch_size", "4"])
    accum = run(fp32, ["--training.local_batch_size", "1", "--training.global_batch_size", "4"])
    # Same global batch, same samples: losses and grad norms agree to float32 summation noise.
    assert accum.losses == pytest.approx(big.losses, rel=1e-5)
    assert accum.grad_norms == pytest.approx(big.grad_norms, rel=1e-5)
    assert len(big.losses) == 4


def test_runs_are_bit_reproducible(tiny_args):
    assert run(tiny_args).losses == run(tiny_args).losses


def test_loss_starts_near_uniform_and_decreases(tiny_args):
    result = run(tiny_args, ["--training.steps", "40", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "4"])
    assert abs(result.losses[0] - math.log(512)) < 1.0  # initial loss ~ ln(vocab)
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.0


def test_nan_loss_stops_with_the_step(tiny_args, monkeypatch):
    import trainer.loss as loss_mod

    real = loss_mod.cross_entropy_sum
    calls = {"n": 0}

    def poisoned(logits, labels):
        calls["n"] += 1
        loss = real(logits, labels)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(loss_mod, "cross_entropy_sum", poisoned)
    with pytest.raises(TrainingDiverged, match="loss is nan at step 3"):
        run(tiny_args)


def test_resolved_config_is_written_and_reloads(tiny_args, tmp_path):
    run(tiny_args, ["--training.steps", "1"])
    written = tmp_path / "run" / "config.toml"
    original = load_config(overrides=tiny_args + ["--training.steps", "1"])
    reloaded = load_config(written)
    # the run's config: [model] attn_mask_type "auto" made concrete for the family
    resolved = dataclasses.replace(original.model, attn_mask_type="block_causal")
    assert original.model.attn_mask_type == "auto"
    assert reloaded.training == original.training and reloaded.model == resolved
