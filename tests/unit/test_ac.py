"""Activation checkpointing and compile leave the numbers unchanged and parameter names intact."""

import pytest
import torch

from trainer.config import load_config
from trainer.train import main


@pytest.mark.parametrize("mode, option", [("full", "2"), ("selective", "2"), ("selective", "op")])
def test_ac_modes_match_no_ac(tiny_args, mode, option):
    base = main(load_config(overrides=tiny_args))
    ac = main(load_config(overrides=tiny_args + ["--activation_checkpoint.mode", mode,
                                                "--activation_checkpoint.selective_ac_option", option]))
    assert ac.losses == pytest.approx(base.losses, rel=1e-6)
    assert ac.grad_norms == pytest.approx(base.grad_norms, rel=1e-6)


def test_ac_keeps_parameter_names():
    from trainer.models.llama import LlamaArgs, Transformer
    from trainer.parallel.ac import apply_ac

    model = Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8))
    names = [n for n, _ in model.named_parameters()]
    apply_ac(model, mode="full", option="1", layers_attr="layers")
    assert [n for n, _ in model.named_parameters()] == names
    model(torch.randint(0, 64, (1, 8))).sum().backward()


@pytest.mark.slow
def test_compile_matches_eager(tiny_args):
    """torch.compile per block (inductor on CPU; about 20 s of compilation) gives the eager numbers."""
    eager = main(load_config(overrides=tiny_args))
    compiled = main(load_config(overrides=tiny_args + ["--compile.enable"]))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    assert compiled.grad_norms == pytest.approx(eager.grad_norms, rel=1e-5)
