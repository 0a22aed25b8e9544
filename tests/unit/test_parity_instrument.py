"""The parity instrument (tests/parity.py) must see what the loss and total grad norm hide.

Each check starts from a single-process recording of the parity models and shows that a
deliberate defect fails the per-tensor comparison: every gradient of every parameter kind
zeroed or scaled by 1.01; and, by training with the defect in place, a wrong gradient during
training, rotary positions off by one token, and query heads permuted.
"""

import pytest
import torch
import torch.nn.functional as F

import trainer.models.decoder.model as llama
from tests.distributed.harness import PARITY, PARITY_RUN
from tests.parity import RTOL, Recorder, compare, record
from trainer.config import load_config

GPT = ["--model.attn_mask_type", "causal", "--model.modules", "tiny_gpt", "--model.name", "tiny_gpt",
       "--model.flavor", "tiny", "--model.overrides.n_layers", "2"]
MODELS = {
    # causal: the rotary mutation below rotates by rows of the (positions, ...) table, not a per-token one
    "llama": PARITY + ["--model.attn_mask_type", "causal"],
    "llama-tied": PARITY + ["--model.attn_mask_type", "causal", "--model.tie_embeddings"],
    "gpt": PARITY_RUN + GPT,
}


def config(model: str, tmp_path, *extra: str):
    return load_config(overrides=MODELS[model] + ["--training.local_batch_size", "8", "--job.dump_folder",
                                                  str(tmp_path), *extra])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(model: str):
        if model not in cache:
            cache[model] = record(config(model, tmp_path_factory.mktemp(model)))
        return cache[model]

    return get


def test_a_run_matches_itself(references, tmp_path):
    _, tensors = references("llama")
    _, again = record(config("llama", tmp_path))
    cmp = compare(again, tensors)
    assert cmp.ok and cmp.worst_rel == 0.0  # deterministic: bit-identical


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("defect", ["zeroed", "scaled by 1.01"])
def test_every_wrong_gradient_is_caught(model, defect, references):
    _, tensors = references(model)
    names = sorted(k for k in tensors if k.startswith("grad/1/"))
    assert len(names) >= 20 and any("norm" in n or "ln_" in n for n in names)
    missed = []
    for key in tensors:
        broken = dict(tensors)
        broken[key] = [t * (0.0 if defect == "zeroed" else 1.01) for t in tensors[key]]
        if compare(broken, tensors).ok:
            missed.append(key)
    # The only tensors a defect cannot show in are those that are zero in exact arithmetic: the
    # GPT family's key bias gets no gradient (softmax ignores a shift shared by every key), so it
    # also stays at its zero init. Every other tensor of every kind is caught.
    zero = {k for k in tensors if k.endswith("k_proj.bias")} if model == "gpt" else set()
    assert set(missed) == zero


def test_copies_that_disagree_are_caught(references):
    _, tensors = references("llama")
    key = "grad/2/layers.1.ffn_norm.weight"
    two = dict(tensors)
    two[key] = [tensors[key][0], tensors[key][0] * (1 + 1e-3)]  # e.g. two data-parallel replicas drifted
    assert not compare(two, tensors).ok
    missing = {k: v for k, v in tensors.items() if k != key}
    assert compare(missing, tensors).failures == [f"{key}: missing"]


class ScaleOneGradient(Recorder):
    """A layout bug stand-in: one tensor's gradient is 1 % too large at every step, before clipping."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def on_grads(self, step, parts):
        dict(parts.chunks[0].named_parameters())[self.name].grad.mul_(1.01)
        super().on_grads(step, parts)


@pytest.mark.parametrize("name", ["layers.0.attention_norm.weight", "layers.1.attention.wq.weight"])
def test_a_wrong_gradient_during_training_is_caught(name, references, tmp_path):
    reference, tensors = references("llama")
    from trainer.train import main

    recorder = ScaleOneGradient(name)
    result = main(config("llama", tmp_path), observer=recorder)
    cmp = compare(recorder.tensors, tensors)
    assert not cmp.ok
    # The tensor itself is flagged at the first step (1 % off), whatever loss and norm say.
    assert f"grad/1/{name}: relative difference" in "\n".join(cmp.failures)
    assert len(result.losses) == len(reference.losses)


def test_rotary_positions_off_by_one_token_are_caught(references, tmp_path, monkeypatch):
    """The second half of every sequence rotated as if one token later, as a context-parallel rank
    with an off-by-one chunk offset would. (Shifting every position alike changes nothing: rotary
    attention sees only distances.)"""
    _, tensors = references("llama")
    real = llama.apply_rope

    def shifted(x, table):
        seq = x.shape[1]
        # Rotating by position p and then by position 1 (row 0 is the identity) puts a token at p + 1.
        extra = torch.cat([table[0:1].expand(seq // 2, -1, -1), table[1:2].expand(seq - seq // 2, -1, -1)])
        return real(real(x, table), extra)

    monkeypatch.setattr(llama, "apply_rope", shifted)
    _, broken = record(config("llama", tmp_path))
    cmp = compare(broken, tensors)
    assert not cmp.ok
    assert any(f.startswith("grad/1/layers.0.attention.wq.weight") for f in cmp.failures)


def test_permuted_query_heads_are_caught(references, tmp_path, monkeypatch):
    _, tensors = references("llama")
    real = F.scaled_dot_product_attention

    def permuted(q, k, v, **kwargs):  # (batch, heads, seq, head_dim): every query head moves by one
        return real(torch.roll(q, 1, dims=1), k, v, **kwargs)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", permuted)
    _, broken = record(config("llama", tmp_path))
    assert not compare(broken, tensors).ok


def test_relative_error_is_judged_per_tensor():
    big, small = torch.ones(1000) * 100, torch.ones(3) * 1e-4
    ref = {"a": [big], "b": [small]}
    off = {"a": [big], "b": [small * (1 + 10 * RTOL)]}
    # A 1e-4 error in a tensor 1e6 times smaller than its neighbour still fails.
    failures = compare(off, ref).failures
    assert len(failures) == 1 and failures[0].startswith("b: relative difference")
