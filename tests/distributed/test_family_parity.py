"""Each dense family built on the shared decoder (issue 60) reproduces one process under two composite layouts: PP 2
x FSDP 2 with the ZBVZeroBubble (V) schedule, and TP 2 x CP 2 under the default block-causal attention. The full
matrix of layouts stays on Llama (test_spmd_parity, test_pp_parity); here each family's own options (q/k biases and
norms, sliding windows shorter than the sequence, norms after the branches, soft-capping, scales) meet the
parallel techniques.

Tiny shapes (dim 64, 4 blocks, 4 heads of 16 with 2 kv heads, vocabulary 512), sliding windows of 8 tokens within
32-token windows of short documents. Compared per tensor like every parity case (tests/parity.py).
"""

import pytest

from tests.distributed.harness import PARITY, PARITY_RUN, Launches, P, selected
from tests.parity import assert_parity, reference_runs

M = "--model.overrides."
SHAPE = [M + "dim", "64", M + "n_layers", "4", M + "n_heads", "4", M + "n_kv_heads", "2", M + "head_dim_override",
         "16", M + "vocab_size", "512", M + "ffn_hidden_override", "96"]
FAMILIES = {
    "qwen2": [],
    "qwen3": [M + "head_dim_override", "32"],  # a head size of its own: 4 x 32 = 128 against dim 64
    "mistral": [M + "sliding_window", "8"],
    "olmo2": [],
    "gemma3_text": [M + "sliding_window", "8", M + "global_every", "2", M + "attn_scale", "0.2"],
    "gemma2": [M + "sliding_window", "8", M + "global_every", "2", M + "attn_scale", "0.2"],
    "granite": [],
}
TP_CP = [P + "tensor_parallel_degree", "2", P + "context_parallel_degree", "2", "--training.local_batch_size", "8"]
LAYOUTS = {
    "PP2xFSDP2-ZBV": [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble",
                      P + "data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
    "TP2xCP2": TP_CP,
}
# Where a family's options refuse a technique (one line at plan time), its second layout keeps the other one.
INSTEAD = {
    ("olmo2", "TP2xCP2"): ("CP2xFSDP2", [P + "context_parallel_degree", "2", P + "data_parallel_shard_degree", "2",
                                         "--training.local_batch_size", "4"]),  # q/k norm over the whole projection
    ("gemma2", "TP2xCP2"): ("TP2xFSDP2", [P + "tensor_parallel_degree", "2", P + "data_parallel_shard_degree", "2",
                                          "--training.local_batch_size", "4"]),  # soft-capped attention logits
}
CASES = [(family, layout) for family in FAMILIES for layout in LAYOUTS]


def base(family: str) -> list[str]:
    return PARITY_RUN + ["--model.name", family] + SHAPE + FAMILIES[family]


def layout_of(family: str, layout: str) -> tuple[str, list[str]]:
    return INSTEAD.get((family, layout), (layout, LAYOUTS[layout]))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, lambda family: base(family) + ["--training.local_batch_size", "8"])


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    cases = {}
    for params in selected(request, "test_a_family_matches_one_process"):
        family, layout = params["family"], params["layout"]
        cases[f"{family}-{layout}"] = (4, base(family) + layout_of(family, layout)[1])
    return Launches(tmp_path_factory.mktemp("launches"), cases)


def test_the_families_and_layouts_plan():
    """Every case plans (so the shared launch runs them all), and the substituted layouts are the refused ones."""
    from tests.conftest import load_plan
    from trainer.errors import ConfigError

    assert PARITY[0] == "--model.overrides.dim"  # PARITY_RUN dropped the tiny Llama's shape
    for family, layout in CASES:
        load_plan(base(family) + layout_of(family, layout)[1], 4)
    for (family, layout) in INSTEAD:
        with pytest.raises(ConfigError, match=r"not supported for this model"):
            load_plan(base(family) + LAYOUTS[layout], 4)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", CASES)
def test_a_family_matches_one_process(family, layout, references, launches, tmp_path):
    result = launches.result(f"{family}-{layout}", tmp_path)
    reference, tensors = references(family)
    assert_parity(f"{family} {layout_of(family, layout)[0]}", result, reference, tensors)
    assert result["losses"][-1] != result["losses"][0]
