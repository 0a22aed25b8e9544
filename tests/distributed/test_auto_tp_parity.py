"""Automatic TP plans reproduce the single-process run, for Llama (hand plan off) and a GPT-2-style
family registered from outside the package, alone and composed with FSDP and pipeline stages.

Tolerance: relative 1e-5 on every step's loss and grad norm, and per tensor on every parameter's
gradient per step and value after the last step (tests/parity.py; fp32, CPU, gloo).
"""

import pytest

from tests.distributed.harness import Launches, P, PARITY, PARITY_RUN, runs, selected
from tests.parity import assert_parity, record, reference_runs
from trainer.config import load_config

AUTO = [P + "tensor_parallel_degree", "2", P + "tensor_parallel_plan", "auto", P + "no-enable_sequence_parallel"]
# The family takes no positions: under the default attention ("auto") it runs causal attention, said once.
GPT = ["--model.modules", "tiny_gpt", "--model.name", "tiny_gpt", "--model.flavor", "tiny"]
# PARITY's Llama overrides do not apply to the GPT family: keep only the run settings.
FAMILIES = {"llama": PARITY + ["--model.overrides.n_layers", "4"],
            "gpt": PARITY_RUN + GPT + ["--model.overrides.n_layers", "4"]}
FUSED = PARITY_RUN + GPT[:-1] + ["tiny_fused", "--model.overrides.n_layers", "4"]  # q, k and v in one projection
LAYOUTS = {
    "TP2": (2, AUTO + ["--training.local_batch_size", "8"]),
    "FSDP2xTP2": (4, AUTO + [P + "data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    "PP2xTP2": (4, AUTO + [P + "pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, lambda family: FAMILIES[family] + ["--training.local_batch_size", "8"])


@pytest.mark.slow
def test_auto_tp_with_replicated_fused_attention(launches, tmp_path):
    """The fused q/k/v projection stays replicated, the MLP is split: still the single-process numbers."""
    reference, tensors = record(load_config(overrides=FUSED + ["--training.local_batch_size", "8", "--job.dump_folder",
                                                               str(tmp_path / "ref")]))
    result = launches.result("gpt fused-TP2", tmp_path)
    assert_parity("auto-TP2 fused qkv (gpt)", result, reference, tensors)


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The selected (family, layout) cases, one shared launch per rank count."""
    cases = [(p["family"], p["layout"]) for p in selected(request, "test_auto_tp_matches_single_process")]
    launches = Launches(tmp_path_factory.mktemp("launches"),
                        {f"{f}-{lay}": (LAYOUTS[lay][0], FAMILIES[f] + LAYOUTS[lay][1]) for f, lay in cases})
    if runs(request, "test_auto_tp_with_replicated_fused_attention"):
        launches.cases["gpt fused-TP2"] = (2, FUSED + LAYOUTS["TP2"][1])
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_auto_tp_matches_single_process(family, layout, references, launches, tmp_path):
    result = launches.result(f"{family}-{layout}", tmp_path)
    reference, tensors = references(family)
    assert_parity(f"auto-{layout} ({family})", result, reference, tensors)
