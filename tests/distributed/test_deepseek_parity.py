"""DeepSeek-V3 (latent attention, grouped sigmoid routing with its moving choosing bias, a shared expert, a dense
first block) reproduces one process under expert parallelism with FSDP, inside ZBVZeroBubble pipeline stages, and
with its heads split by tensor parallelism (sequence-parallel) together with context parallelism. Compared per tensor
like every parity case (tests/parity.py); one shared launch of 4 ranks.

Tiny shapes: dim 64, 4 blocks (the first dense), 4 heads (q through a latent of 24, keys and values from one of 16;
8 unrotated and 8 rotated dimensions per q/k head, values of 12), 8 experts in 4 groups of which 2 are eligible.
"""

import pytest

from tests.distributed.harness import PARITY_RUN, Launches, P, selected
from tests.parity import assert_parity, record
from trainer.config import load_config

M = "--model.overrides."
BASE = PARITY_RUN + ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"] + [
    a for k, v in (("dim", 64), ("n_layers", 4), ("n_heads", 4), ("vocab_size", 512), ("kv_lora_rank", 16),
                   ("q_lora_rank", 24), ("qk_nope_head_dim", 8), ("qk_rope_head_dim", 8), ("v_head_dim", 12),
                   ("head_dim_override", 16), ("dense_hidden_dim", 96), ("expert_hidden_dim", 32))
    for a in (M + k, str(v))]
EP2 = [P + "expert_parallel_degree", "2"]
CASES = {
    "EP2xFSDP2": [P + "data_parallel_shard_degree", "4", *EP2, "--training.local_batch_size", "2"],
    "PP2xEP2-ZBV": [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble",
                    P + "data_parallel_shard_degree", "2", *EP2, "--training.local_batch_size", "4"],
    "TP2xCP2": [P + "tensor_parallel_degree", "2", P + "context_parallel_degree", "2",
                "--training.local_batch_size", "8"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ref")
    return record(load_config(overrides=BASE + ["--training.local_batch_size", "8", "--job.dump_folder", str(dump)]))


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    names = [p["layout"] for p in selected(request, "test_deepseek_matches_one_process")]
    return Launches(tmp_path_factory.mktemp("launches"), {n: (4, BASE + CASES[n]) for n in names})


def test_the_layouts_plan():
    from tests.conftest import load_plan

    for overrides in CASES.values():
        load_plan(BASE + overrides, 4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CASES))
def test_deepseek_matches_one_process(layout, reference, launches, tmp_path):
    result = launches.result(layout, tmp_path)
    assert_parity(f"deepseek_v3 {layout}", result, *reference)
    assert result["losses"][-1] != result["losses"][0]
