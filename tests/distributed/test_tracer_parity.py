"""The tracer pipeline front-end (``pipeline_parallel_frontend = "tracer"``) reproduces the
single-process run, for Llama and for a family the manual front-end cannot cut (tests/fixtures/
seq_gpt.py: blocks in an nn.Sequential, a forward that uses every part), under 1F1B,
Interleaved1F1B and ZBVZeroBubble (1F1B with microbatches of 2), and composed with FSDP 2 (DualPipeV,
full activation checkpointing). Traced and manual splits give the same parameters, and checkpoints cross between
the front-ends both ways.

Compared per tensor like every parity case (tests/parity.py): each step's loss, grad norm and
evaluation loss, every parameter's gradient per step and value after the last step under its
whole-model name; relative 1e-5, fp32, CPU, gloo.
"""

import pytest
import torch

from tests.distributed.harness import Launches, P, PARITY, PARITY_RUN, runs, selected
from tests.parity import REPORT, assert_parity, compare, reference_runs

TRACER = [P + "pipeline_parallel_frontend", "tracer"]
LAYERS4 = ["--model.overrides.n_layers", "4"]
# Both under the default attention: block-causal for Llama (the positions reach every traced stage), causal for
# seq_gpt, which takes no positions. PARITY's Llama overrides do not apply to the GPT family: only its run settings.
FAMILIES = {
    "llama": PARITY + LAYERS4,
    "seq_gpt": PARITY_RUN + ["--model.modules", "seq_gpt", "--model.name", "seq_gpt", "--model.flavor", "tiny",
                             *LAYERS4],
}


def pp2(schedule: str, *extra: str) -> list[str]:
    return [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", schedule, *extra]


B8 = ["--training.local_batch_size", "8"]
MB2 = [P + "pipeline_parallel_microbatch_size", "2"]  # traced at 2 sequences; evaluation runs in chunks of 2
# name: (family, ranks, overrides); every case uses the tracer front-end. seq_gpt cannot be pipelined
# any other way, so its cases also prove that the tracer runs (llama's could fall back to the manual path).
CASES = {
    "llama-1F1B-mb2": ("llama", 2, pp2("1F1B", *B8, *MB2)),
    **{f"{family}-{s}": (family, 2, pp2(s, *B8)) for family in FAMILIES for s in ["Interleaved1F1B", "ZBVZeroBubble"]},
    "seq_gpt-1F1B-mb2": ("seq_gpt", 2, pp2("1F1B", *B8, *MB2)),
    "seq_gpt-pp2xFSDP2-DualPipeV-AC": ("seq_gpt", 4, pp2("DualPipeV", P + "data_parallel_shard_degree", "2",
                                                         "--activation_checkpoint.mode", "full",
                                                         "--training.local_batch_size", "4")),
    "llama-pp2xDDP2-1F1B-SAC": ("llama", 4, pp2("1F1B", P + "data_parallel_replicate_degree", "2",
                                                P + "data_parallel_shard_degree", "1", "--training.local_batch_size",
                                                "4", "--activation_checkpoint.mode", "selective")),
}
# The tracer under HSDP (8 ranks) is a case of test_pp_parity's shared 8-rank launch: pp2xHSDP2x2-csv-SAC-op-tracer.


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, lambda family: FAMILIES[family] + B8)


def case_args(name: str, folder) -> list[str]:
    """Every argument of the case's run; a CSV schedule ({csvN}: N microbatches) is written to ``folder``."""
    from tests.distributed.test_pp_parity import write_csv

    family, _, overrides = CASES[name]
    overrides = [str(write_csv(folder, int(o[4:-1] or 8))) if o.startswith("{csv") else o for o in overrides]
    return FAMILIES[family] + overrides + TRACER


CROSS = ["--training.steps", "9", "--checkpoint.enable", "--checkpoint.interval", "3",
         "--checkpoint.no-last_save_model_only"]


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The selected cases, and the runs of the two tests after them, one shared launch per rank count."""
    names = [p["name"] for p in selected(request, "test_traced_pipeline_matches_single_process")]
    folder = tmp_path_factory.mktemp("launches")
    launches = Launches(folder, {n: (CASES[n][1], case_args(n, folder)) for n in names})
    if runs(request, "test_traced_and_manual_splits_give_the_same_parameters"):
        launches.cases.setdefault("llama-1F1B-mb2", (2, case_args("llama-1F1B-mb2", folder)))
        launches.cases["manual llama-1F1B-mb2"] = (2, FAMILIES["llama"] + CASES["llama-1F1B-mb2"][2])
    if runs(request, "test_checkpoints_cross_between_the_front_ends"):
        # The manual run resumes from the traced run's step 3 and saves steps 6 and 9 in its folder, replacing the
        # traced run's: the traced resume that follows starts from the manual run's step 6.
        llama = FAMILIES["llama"] + pp2("1F1B", *B8) + CROSS
        launches.cases["cross straight"] = (2, llama + TRACER)
        saves = ["--checkpoint.folder", str(launches.dump("cross straight") / "checkpoint")]
        launches.cases["cross manual from 3"] = (2, llama + saves + ["--checkpoint.load_step", "3"])
        launches.cases["cross traced from 6"] = (2, llama + TRACER + saves + ["--checkpoint.load_step", "6"])
    if runs(request, "test_traced_stages_that_lose_the_positions_are_caught"):  # last: undone after its case
        launches.cases["lost positions"] = (2, FAMILIES["llama"] + pp2("ZBVZeroBubble", *B8) + TRACER,
                                            "tracer_drops_positions")
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_traced_pipeline_matches_single_process(name, references, launches, tmp_path):
    family, nproc, overrides = CASES[name]
    result = launches.result(name, tmp_path)
    reference, tensors = references(family)
    assert_parity(f"tracer {name}", result, reference, tensors)
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.slow
def test_traced_stages_that_lose_the_positions_are_caught(references, launches, tmp_path):
    """Broken on purpose: the traced blocks attend across documents (their positions replaced by the window's):
    the per-tensor comparison with the block-causal single process must fail."""
    reference, tensors = references("llama")
    result = launches.result("lost positions", tmp_path)
    assert not compare(result["tensors"], tensors).ok


@pytest.mark.slow
def test_traced_and_manual_splits_give_the_same_parameters(launches, tmp_path):
    """Same split points, same schedule: the two front-ends run the same operations."""
    traced = launches.result("llama-1F1B-mb2", tmp_path)
    manual = launches.result("manual llama-1F1B-mb2", tmp_path)
    params = [k for k in manual["tensors"] if k.startswith("param/")]
    assert params and set(params) == {k for k in traced["tensors"] if k.startswith("param/")}
    worst = 0.0
    for key in params:
        a, b = traced["tensors"][key][0], manual["tensors"][key][0]
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=key)
        worst = max(worst, ((a - b).norm() / b.norm()).item())
    REPORT.append(f"{'tracer vs manual pp2 1F1B mb2 params':<34} worst {worst:.2e}")


@pytest.mark.slow
def test_checkpoints_cross_between_the_front_ends(launches, tmp_path):
    """A traced run's step-3 checkpoint resumes in a manual run (steps 4-9), whose step-6 checkpoint
    resumes in a traced run (steps 7-9); both reproduce the straight traced run, every tensor."""
    straight = launches.result("cross straight", tmp_path)
    manual = launches.result("cross manual from 3", tmp_path)
    traced = launches.result("cross traced from 6", tmp_path)
    for name, result, first in [("tracer ckpt -> manual", manual, 4), ("manual ckpt -> tracer", traced, 7)]:
        assert result["losses"] == pytest.approx(straight["losses"][first - 1:], rel=1e-5), name
        # the resumed run numbers its steps from the checkpoint, so its keys match the straight run's
        later = tuple(f"grad/{s}/" for s in range(first, 10)) + ("param/",)
        cmp = compare(result["tensors"], {k: v for k, v in straight["tensors"].items() if k.startswith(later)})
        REPORT.append(f"{name:<34} worst {cmp.worst_rel:.2e}  {cmp.worst_key}")
        assert cmp.ok, (name, cmp.failures[:10])
