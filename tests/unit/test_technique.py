"""The parallel-technique protocol (trainer.parallel.technique): a technique added to ``TECHNIQUES`` and
nothing else takes part in the plan's checks, the chunk build, the training step and evaluation."""

import contextlib

import pytest
import torch

import trainer.parallel.parallelize as parallelize
import trainer.train as train_mod
from tests.conftest import load_plan
from trainer.config import load_config
from trainer.errors import ConfigError, UserError
from trainer.parallel.technique import Technique


class HalfSequences(Technique):
    """A toy technique: every rank trains on the first half of each sequence, and it records each call."""

    name = "toy"
    refuse = False
    calls: dict

    @classmethod
    def check(cls, facts):
        cls.calls["check"] += 1
        if cls.refuse:
            raise ConfigError(f"[toy] cannot run {facts.family}")

    @classmethod
    def build(cls, setup):
        cls.calls["build"] += 1
        return cls()

    def apply(self, chunk):
        self.calls["apply"] += 1
        self.calls["meta_at_apply"] = all(p.is_meta for p in chunk.parameters())

        def seen(module, args):
            self.calls["lengths"].add(args[0].shape[1])
            self.calls["autocast"].add(torch.is_autocast_enabled(args[0].device.type))

        chunk.register_forward_pre_hook(seen)

    def after_materialize(self, chunk):
        assert not any(p.is_meta for p in chunk.parameters())
        self.calls["materialized"] += 1

    def shard(self, x):
        return x[:, : x.shape[1] // 2]

    @contextlib.contextmanager
    def _entered(self):
        self.calls["contexts"] += 1
        yield

    def step_context(self):
        return self._entered()

    def gradient_sync(self, chunk, enabled):
        self.calls["sync"].append(enabled)

    def after_first_step(self):
        self.calls["first_step"] += 1
        if self.refuse_after_step:
            raise UserError("[toy] did not take effect")

    refuse_after_step = False


@pytest.fixture
def toy(monkeypatch):
    HalfSequences.calls = {"check": 0, "build": 0, "apply": 0, "materialized": 0, "contexts": 0, "first_step": 0,
                           "lengths": set(), "autocast": set(), "sync": []}
    monkeypatch.setattr(parallelize, "TECHNIQUES", [*parallelize.TECHNIQUES, HalfSequences])
    return HalfSequences


def test_a_technique_registered_in_the_list_runs_everywhere(toy, tiny_args):
    seq_len = 32
    config = load_config(overrides=[*tiny_args, "--training.seq_len", str(seq_len), "--training.steps", "2",
                                    "--training.local_batch_size", "4", "--training.global_batch_size", "8",
                                    "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                                    "--training.mixed_precision_param", "float32"])  # also on CUDA ("auto": bf16)
    result = train_mod.main(config)
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    calls = toy.calls
    assert calls["check"] == 1 and calls["build"] == 1  # one plan, one rank
    assert calls["apply"] == 1 and calls["materialized"] == 1  # one chunk
    assert calls["meta_at_apply"]  # applied before the weights exist
    assert calls["lengths"] == {seq_len // 2}  # every forward, training and validation, saw its shard
    # 2 steps x 2 accumulation microbatches, then 1 validation batch of 2 microbatches
    assert calls["contexts"] == 2 * 2 + 2
    assert calls["first_step"] == 1
    assert calls["sync"] == [False, True] * 2  # each step reduces with its last microbatch only
    assert calls["autocast"] == {False}  # float32: no autocast


@pytest.mark.parametrize("casts", [False, True])
def test_a_technique_that_casts_parameters_turns_autocast_off(toy, tiny_args, monkeypatch, casts):
    monkeypatch.setattr(toy, "casts_parameters", casts)
    train_mod.main(load_config(overrides=[*tiny_args, "--training.steps", "1",
                                          "--training.mixed_precision_param", "bfloat16"]))
    assert toy.calls["autocast"] == {not casts}


def test_its_plan_time_refusal_and_first_step_check_reach_the_user(toy, tiny_args, monkeypatch):
    monkeypatch.setattr(toy, "refuse", True)
    with pytest.raises(ConfigError, match=r"^\[toy\] cannot run llama3 debugmodel$"):
        load_plan(tiny_args)
    monkeypatch.setattr(toy, "refuse", False)
    monkeypatch.setattr(toy, "refuse_after_step", True)
    with pytest.raises(UserError, match=r"^\[toy\] did not take effect$"):
        train_mod.main(load_config(overrides=[*tiny_args, "--training.steps", "2"]))
