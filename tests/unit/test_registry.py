"""Registering a model family from the user's own module, named in the config."""

import pytest

import trainer.train as train_mod
from tests.conftest import load_plan
from trainer.config import load_config
from trainer.errors import ConfigError

GPT = ["--model.attn_mask_type", "causal", "--model.modules", "tiny_gpt", "--model.name", "tiny_gpt",
       "--model.flavor", "tiny"]


def test_custom_family_trains_from_config(tiny_run_args):
    result = train_mod.main(load_config(overrides=tiny_run_args + GPT
                                        + ["--training.steps", "30", "--optimizer.lr", "3e-3"]))
    assert result.losses[-1] < result.losses[0] - 0.5


def test_custom_family_overrides_are_checked():
    assert load_config(overrides=GPT + ["--model.overrides.dim", "32"]).model.overrides == {"dim": 32}
    with pytest.raises(ConfigError, match=r"\[model.overrides\] n_kv_heads: not a field of tiny_gpt args"):
        load_plan(GPT + ["--model.overrides.n_kv_heads", "2"])
    with pytest.raises(ConfigError, match="tiny_gpt does not support tied embeddings"):
        load_plan(GPT + ["--model.tie_embeddings"])
    with pytest.raises(ConfigError, match=r"\[model.overrides\] dim: got 1.5, expected a int"):
        load_plan(GPT + ["--model.overrides.dim", "1.5"])
