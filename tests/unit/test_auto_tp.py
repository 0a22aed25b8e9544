"""Deriving tensor-parallel plans from a block's structure (meta device, no process group)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests.conftest import load_plan
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.models.llama import LlamaArgs, Transformer
from trainer.models.decoder.tp_plan import build_tp_plan
from trainer.models.registry import ModelLayout
from trainer.parallel.auto_tp import derive_tp_plan


def derive(model, tp=2, pre=("tok_embeddings",), post=("norm", "output"), loss_parallel=True):
    return derive_tp_plan(model, layout(model, pre, post), tp=tp, seq_len=16, loss_parallel=loss_parallel)


def layout(model, pre=("tok_embeddings",), post=("norm", "output")):
    """The layout the family's spec would give (these test models keep their args on the model)."""
    return ModelLayout("layers", pre, post, vocab_size=getattr(getattr(model, "args", None), "vocab_size", None))


def meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def styles(plan: dict) -> dict:
    return {name: type(style).__name__ for name, style in plan.items()}


def test_llama_derived_plan_equals_the_hand_plan_without_sequence_parallel():
    model = meta(Transformer, LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                        multiple_of=32, max_seq_len=16))
    derived = derive(model)
    top, block = build_tp_plan(sequence_parallel=False, loss_parallel=True)
    block = {name: style for name, style in block.items() if name in dict(model.layers["0"].named_modules())}
    assert styles(derived.block) == styles(block) and styles(derived.top) == styles(top)
    assert derived.replicated == {}
    # Same layouts, not only the same classes.
    for name, style in {**top, **block}.items():
        mine = {**derived.top, **derived.block}[name]
        assert (mine.input_layouts, mine.output_layouts, mine.use_local_output) == (
            style.input_layouts, style.output_layouts, style.use_local_output), name


def test_a_linear_feeding_a_norm_with_weights_stays_replicated():
    """Qwen 3's per-head q/k norms: split q/k projections would give the norms' weights a gradient
    from one shard's heads only, so automatic TP keeps attention whole (the hand plan handles them)."""
    from trainer.models.decoder.args import DecoderArgs
    from trainer.models.decoder.model import Transformer as Decoder

    model = meta(Decoder, DecoderArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                      multiple_of=32, max_seq_len=16, qk_norm="head"))
    plan = derive(model)
    assert "attention.q_norm" in plan.replicated["attention.wq"]
    assert "attention.k_norm" in plan.replicated["attention.wk"]
    assert {"attention.wq", "attention.wk", "attention.wv", "attention.wo"} <= set(plan.replicated)
    assert styles(plan.block) == {"feed_forward.w1": "ColwiseParallel", "feed_forward.w3": "ColwiseParallel",
                                  "feed_forward.w2": "RowwiseParallel"}


class Args:
    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


class Toy(nn.Module):
    """A model around one kind of block, so derive_tp_plan can run it."""

    def __init__(self, block_cls, dim=8, vocab=32):
        super().__init__()
        self.args = Args(vocab)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({"0": block_cls(dim)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class Chain(nn.Module):
    """x + c(relu(b(relu(a(x))))): a three-deep chain. a and b form a region (b's all-reduce makes
    its output whole again); c would start a new region but writes to the residual stream."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 4 * d), nn.Linear(4 * d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.c(F.relu(self.b(F.relu(self.a(x)))))


class Leaky(nn.Module):
    """x + a(x) + b(relu(a(x))): a's output reaches the residual stream directly."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        y = self.a(x)
        return x + y + self.b(F.relu(y))


class Odd(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 3 * d + 1), nn.Linear(3 * d + 1, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def test_deep_chain_pairs_what_it_can_and_replicates_the_rest(caplog):
    with caplog.at_level(logging.WARNING):
        plan = derive(meta(Toy, Chain))
    assert styles(plan.block) == {"a": "ColwiseParallel", "b": "RowwiseParallel"}
    assert plan.replicated == {"c": "its output reaches the residual stream directly"}
    assert "layers.*.c stays replicated" in caplog.text


def test_entry_feeding_the_residual_is_refused():
    plan = derive(meta(Toy, Leaky))
    assert plan.block == {}
    assert plan.replicated["a"] == "its output reaches the residual stream directly"


def test_unshardable_sizes_are_reported_before_building():
    with pytest.raises(ConfigError,
                       match=r"layers\.\*\.up has 25 output features, not divisible by tensor_parallel_degree=2"):
        derive(meta(Toy, Odd))


def test_top_level_vocab_modules_are_split():
    plan = derive(meta(Toy, Chain), loss_parallel=False)
    assert styles(plan.top) == {"tok_embeddings": "RowwiseParallel", "output": "ColwiseParallel"}
    assert isinstance(plan.top["output"], ColwiseParallel) and plan.top["output"].use_local_output


def test_gpt_family_separate_and_fused_projections():
    import tiny_gpt

    separate = derive(meta(tiny_gpt.GPT, tiny_gpt.GPTArgs()), pre=("wte", "wpe"), post=("ln_f", "lm_head"))
    assert styles(separate.block) == {"q_proj": "ColwiseParallel", "k_proj": "ColwiseParallel",
                                      "v_proj": "ColwiseParallel", "attn_proj": "RowwiseParallel",
                                      "c_fc": "ColwiseParallel", "mlp_proj": "RowwiseParallel"}
    assert "wpe" not in separate.top  # position embeddings are not over the vocabulary
    fused = derive(meta(tiny_gpt.GPT, tiny_gpt.GPTArgs(fused_qkv=True)), pre=("wte", "wpe"), post=("ln_f", "lm_head"))
    assert set(fused.replicated) == {"c_attn", "attn_proj"}
    assert isinstance(fused.block["c_fc"], ColwiseParallel) and isinstance(fused.block["mlp_proj"], RowwiseParallel)


def test_config_requires_auto_for_a_family_without_a_plan():
    gpt = ["--model.attn_mask_type", "causal", "--model.modules", "tiny_gpt", "--model.name", "tiny_gpt",
           "--model.flavor", "tiny", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "32"]
    with pytest.raises(ConfigError, match='tiny_gpt has no hand-written TP plan; set .* tensor_parallel_plan = "auto"'):
        load_plan(gpt)
    auto = load_plan(gpt + ["--parallelism.tensor_parallel_plan", "auto"])
    assert auto.tp_plan.derived


def test_overrides_replace_derived_styles():
    model = meta(Transformer, LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                        multiple_of=32, max_seq_len=16))
    plan = derive_tp_plan(model, layout(model), tp=2, seq_len=16, loss_parallel=True,
                          overrides={"feed_forward.w1": "replicate", "output": "replicate"})
    assert ("feed_forward.w1" not in plan.block
            and plan.replicated["feed_forward.w1"] == "set by tensor_parallel_overrides")
    assert "output" not in plan.top
    with pytest.raises(ConfigError, match=r"tensor_parallel_overrides\] attention.wz: not a Linear of the block"):
        derive_tp_plan(model, layout(model, (), ()), tp=2, seq_len=16, loss_parallel=True,
                       overrides={"attention.wz": "colwise"})
    with pytest.raises(ConfigError, match="got 'columns', expected 'colwise'"):
        derive_tp_plan(model, layout(model, (), ()), tp=2, seq_len=16, loss_parallel=True,
                       overrides={"attention.wq": "columns"})
    with pytest.raises(ConfigError, match='apply to tensor_parallel_plan = "auto" only'):
        load_config(overrides=["--parallelism.tensor_parallel_degree", "2",
                               "--parallelism.tensor_parallel_overrides.attention.wq", "colwise"])


def test_a_weight_read_by_its_parents_code_is_refused_not_left_whole():
    """Attention sinks (one logit per head, read by the attention's own code) leave no trace in the graph of
    Linears: left whole while the heads are split, they broke the first step; now the plan is refused in one line."""
    with pytest.raises(ConfigError, match=r'tensor_parallel_plan = "auto": layers.N.attention.sinks is read by its'
                                          r" parent's code"):
        load_plan(["--model.overrides.attn_sinks", "true", "--parallelism.tensor_parallel_degree", "2",
                   "--parallelism.tensor_parallel_plan", "auto"], 2)
