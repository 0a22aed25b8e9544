"""gpt-oss reproduces one process under expert parallelism with FSDP, inside pipeline stages (ZBVZeroBubble, V
placement) and with tensor parallelism (the sinks sharded with the heads). Its own parameters (attention sinks, the
output and q/k/v biases, the router's bias, the experts' biases) are compared per tensor with every other gradient
(tests/parity.py). Context parallelism is refused for sinks at plan time.

Tiny shapes: dim 64, 4 heads of 16 with 2 kv heads, 8 experts of 32 (2 per token), sliding windows of 8 tokens
alternating with full layers in 32-token windows of short documents, the SwiGLU clamp at 0.1 (reached at init).
"""

import pytest

from tests.conftest import load_plan
from tests.distributed.harness import PARITY_RUN, Launches, P, selected
from tests.parity import assert_parity, record
from trainer.config import load_config

M = "--model.overrides."
BASE = PARITY_RUN + ["--model.name", "gpt_oss", "--model.flavor", "debugmodel", M + "dim", "64", M + "n_layers", "4",
                     M + "n_heads", "4", M + "n_kv_heads", "2", M + "head_dim_override", "16", M + "vocab_size", "512",
                     M + "n_experts", "8", M + "top_k", "2", M + "expert_hidden_dim", "32", M + "sliding_window", "8",
                     M + "swiglu_limit", "0.1"]
EP2 = [P + "expert_parallel_degree", "2"]
CASES = {
    "EP2xFSDP2": [P + "data_parallel_shard_degree", "4", *EP2, "--training.local_batch_size", "2"],
    "PP2xFSDP2xEP2-ZBV": [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble",
                          P + "data_parallel_shard_degree", "2", *EP2, "--training.local_batch_size", "4"],
    "EP2xTP2": [*EP2, P + "tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ref")
    return record(load_config(overrides=BASE + ["--training.local_batch_size", "8", "--job.dump_folder", str(dump)]))


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    names = [p["name"] for p in selected(request, "test_gpt_oss_matches_one_process")]
    return Launches(tmp_path_factory.mktemp("launches"), {n: (4, BASE + CASES[n]) for n in names})


def test_gpt_oss_plans_and_context_parallelism_is_refused_for_sinks():
    from trainer.errors import ConfigError

    for overrides in CASES.values():
        load_plan(BASE + overrides, 4)
    with pytest.raises(ConfigError, match=r"context_parallel_degree=2: .*attn_sinks"):
        load_plan(BASE + [P + "context_parallel_degree", "2", P + "data_parallel_shard_degree", "2",
                         "--training.local_batch_size", "4"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_gpt_oss_matches_one_process(name, reference, launches, tmp_path):
    result = launches.result(name, tmp_path)
    single, tensors = reference
    assert any(k.endswith("attention.sinks.weight") for k in tensors) and any(k.endswith("w2_bias") for k in tensors)
    assert_parity(f"gpt_oss {name}", result, single, tensors)
    assert result["losses"][-1] != result["losses"][0]
