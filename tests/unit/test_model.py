"""Llama model: shapes, causality, parameter count and FLOPs formula, deterministic split-independent init."""

import dataclasses

import pytest
import torch

from trainer.models import get_model_spec
from trainer.models.init import materialize_
from trainer.models.llama import LlamaArgs, Transformer
from trainer.models.llama import FLAVORS
from trainer.models.decoder.model import decoder_flops_per_token as llama_flops_per_token

ARGS = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=32, max_seq_len=16)


def build(args=ARGS, seed=0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    materialize_(model, torch.device("cpu"), seed)
    return model


def test_forward_shape_and_causality():
    model = build()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, 300)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 300
    logits2 = model(changed)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)  # the past never sees the future
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_parameter_count_matches_formula():
    model = build()
    a = ARGS
    kv = a.num_kv_heads * a.head_dim
    per_layer = a.dim * (2 * a.dim + 2 * kv) + 3 * a.dim * a.ffn_hidden_dim + 2 * a.dim
    expected = 2 * a.vocab_size * a.dim + a.n_layers * per_layer + a.dim
    assert sum(p.numel() for p in model.parameters()) == expected


def test_flops_formula():
    a = ARGS
    kv = a.num_kv_heads * a.head_dim
    matmul = a.n_layers * (a.dim * (2 * a.dim + 2 * kv) + 3 * a.dim * a.ffn_hidden_dim) + a.dim * a.vocab_size
    assert llama_flops_per_token(a, 16) == 6 * matmul + 12 * a.n_layers * a.dim * 16
    spec = get_model_spec("llama3")
    # 8B: 6 * 7.5e9 matmul weights = 4.5e10, plus 1.29e10 for attention at 8k context.
    assert 5.7e10 < spec.flops_per_token(FLAVORS["8B"], 8192) < 5.9e10


@pytest.mark.parametrize(
    "flavor, billions", [("1B", 1.24), ("3B", 3.21), ("8B", 8.03), ("70B", 70.6), ("405B", 405.9)]
)
def test_real_flavor_sizes(flavor, billions):
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) / billions < 0.02, count


def test_init_is_deterministic_and_seed_dependent():
    a, b, c = build(seed=3), build(seed=3), build(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_is_independent_of_the_split():
    full = build(seed=7)
    with torch.device("meta"):
        chunk = Transformer(ARGS)
    chunk.tok_embeddings = None
    del chunk.layers["0"]
    materialize_(chunk, torch.device("cpu"), 7)
    full_params = dict(full.named_parameters())
    names = [n for n, _ in chunk.named_parameters()]
    assert names and all(not n.startswith(("tok_embeddings", "layers.0.")) for n in names)
    for name, param in chunk.named_parameters():
        assert torch.equal(param, full_params[name]), name


def test_chunk_passes_hidden_states():
    full = build()
    first, last = build(), build()
    for name in ("1", "2"):
        del first.layers[name]
    first.norm = first.output = None
    last.tok_embeddings = None
    del last.layers["0"]
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=0, atol=0)


def test_tied_embeddings_share_one_weight():
    tied = build(dataclasses.replace(ARGS, tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = sum(p.numel() for p in build().parameters())
    assert sum(p.numel() for p in tied.parameters()) == untied - ARGS.vocab_size * ARGS.dim


@pytest.mark.parametrize("rope", [
    # gpt-oss: the attention factor from the factor, the blend's bounds not rounded
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    # DeepSeek-V3: the attention factor a ratio of two mscales, the bounds rounded outwards
    {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
], ids=["gpt-oss", "deepseek-v3"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.models.decoder.args import DecoderArgs
    from trainer.models.decoder.hf import rope_args
    from trainer.models.decoder.model import rope_attention_factor, rope_frequencies

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                         rope_parameters=dict(rope))
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = DecoderArgs(dim=256, n_heads=4, **rope_args(config.to_dict()))
    torch.testing.assert_close(rope_frequencies(args), expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(args) == pytest.approx(factor, rel=1e-12)
    assert factor != 1.0
