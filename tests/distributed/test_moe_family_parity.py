"""The mixture-of-experts families people bring from the Hub (issue 61) reproduce one process, each under expert
parallelism with FSDP and inside pipeline stages under ZBVZeroBubble (V placement, EP inside), plus the layouts
that split each family's own parts: gpt-oss's sinks sharded with the heads under EP x TP, DeepSeek-V3's latent
attention with its heads split (TP, its shared rotary key's gradient summed over the tp ranks) under CP. Every
gradient is compared per tensor (tests/parity.py), the families' own parameters included (sinks, biases, the
router's bias, the latent projections). All cases share one launch of 4 ranks. Context parallelism is refused for
sinks at plan time.

Tiny shapes: dim 64, 4 blocks, 4 heads of 16 with 2 kv heads, 8 experts of 32 (2 per token), sliding windows of
8 tokens within 32-token windows of short documents; gpt-oss's SwiGLU clamp at 0.1 (reached at init).
"""

import pytest

from tests.conftest import load_plan
from tests.distributed.harness import PARITY_RUN, Launches, P, selected
from tests.parity import assert_parity, reference_runs

M = "--model.overrides."
SHAPE = [M + "dim", "64", M + "n_layers", "4", M + "n_heads", "4", M + "n_kv_heads", "2", M + "head_dim_override",
         "16", M + "vocab_size", "512", M + "n_experts", "8", M + "top_k", "2", M + "expert_hidden_dim", "32"]
FAMILIES = {
    "gpt_oss": SHAPE + [M + "sliding_window", "8", M + "swiglu_limit", "0.1"],
    "mixtral": SHAPE + [M + "sliding_window", "8"],
    # latent attention: q through a latent of 24, keys and values from one of 16; 8 unrotated and 8 rotated
    # dimensions per q/k head, values of 12; the flavor's 8 experts in 4 groups of which 2 are eligible, a shared
    # expert, the first block dense
    "deepseek_v3": [a for k, v in (("dim", 64), ("n_layers", 4), ("n_heads", 4), ("vocab_size", 512),
                                   ("kv_lora_rank", 16), ("q_lora_rank", 24), ("qk_nope_head_dim", 8),
                                   ("qk_rope_head_dim", 8), ("v_head_dim", 12), ("head_dim_override", 16),
                                   ("dense_hidden_dim", 96), ("expert_hidden_dim", 32)) for a in (M + k, str(v))],
}
EP2 = [P + "expert_parallel_degree", "2"]
LAYOUTS = {
    "EP2xFSDP2": [P + "data_parallel_shard_degree", "4", *EP2, "--training.local_batch_size", "2"],
    "PP2xFSDP2xEP2-ZBV": [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble",
                          P + "data_parallel_shard_degree", "2", *EP2, "--training.local_batch_size", "4"],
    "EP2xTP2": [*EP2, P + "tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    # latent attention's heads split (sequence parallel: its input gathered on entry) with context parallelism
    "TP2xCP2": [P + "tensor_parallel_degree", "2", P + "context_parallel_degree", "2",
                "--training.local_batch_size", "8"],
}
CASES = [("gpt_oss", "EP2xFSDP2"), ("gpt_oss", "PP2xFSDP2xEP2-ZBV"), ("gpt_oss", "EP2xTP2"),
         ("mixtral", "EP2xFSDP2"), ("mixtral", "PP2xFSDP2xEP2-ZBV"),
         ("deepseek_v3", "EP2xFSDP2"), ("deepseek_v3", "PP2xFSDP2xEP2-ZBV"), ("deepseek_v3", "TP2xCP2")]
# what each family must have among its compared tensors (its own parameters)
OWN = {"gpt_oss": ("attention.sinks.weight", "w2_bias", "router.gate.bias"), "mixtral": ("moe.experts.w1",),
       "deepseek_v3": ("attention.wkv_a", "attention.kv_a_norm", "moe.shared_experts")}


def base(family: str) -> list[str]:
    return PARITY_RUN + ["--model.name", family, "--model.flavor", "debugmodel"] + FAMILIES[family]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, lambda family: base(family) + ["--training.local_batch_size", "8"])


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    cases = {}
    for params in selected(request, "test_a_moe_family_matches_one_process"):
        family, layout = params["family"], params["layout"]
        cases[f"{family}-{layout}"] = (4, base(family) + LAYOUTS[layout])
    return Launches(tmp_path_factory.mktemp("launches"), cases)


def test_the_families_and_layouts_plan_and_context_parallelism_is_refused_for_sinks():
    from trainer.errors import ConfigError

    for family, layout in CASES:
        load_plan(base(family) + LAYOUTS[layout], 4)
    with pytest.raises(ConfigError, match=r"context_parallel_degree=2: .*attn_sinks"):
        load_plan(base("gpt_oss") + [P + "context_parallel_degree", "2", P + "data_parallel_shard_degree", "2",
                                     "--training.local_batch_size", "4"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", CASES)
def test_a_moe_family_matches_one_process(family, layout, references, launches, tmp_path):
    result = launches.result(f"{family}-{layout}", tmp_path)
    single, tensors = references(family)
    for own in OWN[family]:
        assert any(own in k for k in tensors), (family, own)
    assert_parity(f"{family} {layout}", result, single, tensors)
    assert result["losses"][-1] != result["losses"][0]
