"""Expert parallelism reproduces the single-process MoE run: EP alone, with FSDP, with TP, inside
pipeline stages under 1F1B, ZBVZeroBubble and DualPipeV, and a resume on one process from an EP
checkpoint. Compared per tensor like every parity case (tests/parity.py): each step's loss and grad
norm, every parameter's gradient per step and value after the last step; relative 1e-5, fp32.

The tiny MoE uses both balancing mechanisms (the bias moves every step from the global expert
loads; the sequence-wise balance loss adds its gradient), so they are compared too. Routing is the
same in every layout because the router sees the same hidden states (up to float32 rounding)
and ties go to the lower expert index (a stable sort).
"""

import pytest

from tests.conftest import load_plan
from tests.distributed.harness import VARLEN, Launches, P, PARITY, runs, selected
from tests.distributed.test_pp_parity import check_activation_estimate
from tests.parity import REPORT, assert_parity, compare, record
from trainer.config import load_config

M = "--model.overrides."
# 3 blocks (the first dense), 8 experts of which each token takes 2; 4 blocks when pipelined.
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel", M + "dim", "64", M + "n_heads", "4",
       M + "n_kv_heads", "2", M + "vocab_size", "512", M + "n_layers", "3", M + "n_dense_layers", "1",
       M + "dense_hidden_dim", "96", M + "n_experts", "8", M + "top_k", "2", M + "expert_hidden_dim", "32",
       M + "bias_update_speed", "0.001", M + "aux_loss_coef", "0.01"]
assert PARITY[0] == "--model.overrides.dim" and PARITY[10] == "--training.seq_len"
BASE = PARITY[10:] + MOE  # PARITY[:10] is the tiny Llama's shape
EP2 = [P + "expert_parallel_degree", "2"]
TIED = "--model.tie_embeddings"
LAYERS4 = [M + "n_layers", "4"]
SAVE = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]


def pp(schedule: str) -> list[str]:
    return [P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", schedule,
            P + "data_parallel_shard_degree", "2", *EP2, *LAYERS4, "--training.local_batch_size", "4"]


CASES = {
    "EP2": (2, [], EP2 + ["--training.local_batch_size", "4"]),
    "EP2+SAC-op": (2, [], EP2 + ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                 "--activation_checkpoint.selective_ac_option", "op"]),
    "EP2xFSDP2": (4, [], [P + "data_parallel_shard_degree", "4", *EP2, "--training.local_batch_size", "2"]),
    # Clipping that engages (every run's norm is below 1.0) on expert and non-expert gradients.
    "EP2+clip": (2, ["--training.max_norm", "0.3"], EP2 + ["--training.local_batch_size", "4", "--training.max_norm",
                                                             "0.3"]),
    # Data-parallel replicas: the experts' gradient average and FSDP over the replica dimension too.
    "HSDP2x2xEP2": (4, [], [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "2", *EP2,
                            "--training.local_batch_size", "2"]),
    "EP2xTP2": (4, [], [*EP2, P + "tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "PP2xEP2-1F1B": (4, LAYERS4, pp("1F1B")),
    "PP2xEP2-ZBV": (4, LAYERS4, pp("ZBVZeroBubble")),
    "PP2xEP2-DualPipeV": (4, LAYERS4, pp("DualPipeV")),
    "EP2xTP2+varlen": (4, VARLEN, [*VARLEN, *EP2, P + "tensor_parallel_degree", "2",
                                   "--training.local_batch_size", "4"]),
    # compositions (docs/parallelism.md's composition table names each pair's case)
    "PP2xEP2-Interleaved1F1B-AC-tied-compile": (4, LAYERS4 + [TIED], pp("Interleaved1F1B") + [
        TIED, "--activation_checkpoint.mode", "full", "--compile.enable"]),
    "PP2xEP2-csv-SAC": (4, LAYERS4, [
        P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule_csv", "{csv4}",
        P + "data_parallel_shard_degree", "2", *EP2, *LAYERS4, "--training.local_batch_size", "4",
        "--activation_checkpoint.mode", "selective"]),
    "DDP2+SAC-op+compile": (2, [], [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1",
                                    "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "op", "--compile.enable"]),
    # the sequence-wise balance loss needs whole sequences on a rank: context parallelism runs without it
    "CP2xFSDP2": (4, [M + "aux_loss_coef", "0"], [M + "aux_loss_coef", "0", P + "context_parallel_degree", "2",
                                                 P + "data_parallel_shard_degree", "2", "--training.local_batch_size",
                                                 "4"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(extra: tuple[str, ...]):
        if extra not in cache:
            dump = tmp_path_factory.mktemp("ref")
            overrides = BASE + list(extra) + ["--training.local_batch_size", "8", "--job.dump_folder", str(dump)]
            cache[extra] = record(load_config(overrides=overrides))
        return cache[extra]

    return get


METERED = ("EP2", "PP2xEP2-ZBV")  # these launches also measure the saved activations of step 2


def case_overrides(name: str, folder=None) -> list[str]:
    """The case's overrides; a CSV schedule ({csvN}: N microbatches) is written to ``folder``."""
    nproc, ref_extra, overrides = CASES[name]
    for i, o in enumerate(overrides):
        if o.startswith("{csv"):
            from tests.distributed.test_pp_parity import write_csv

            overrides = overrides[:i] + [str(write_csv(folder, int(o[4:-1] or 8)))] + overrides[i + 1:]
    return overrides + (["--profiling.activation_memory_steps", "2"] if name in METERED else [])


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The selected cases, one shared launch per rank count."""
    names = [p["name"] for p in selected(request, "test_expert_parallel_layout_matches_single_process")]
    folder = tmp_path_factory.mktemp("launches")
    launches = Launches(folder, {n: (CASES[n][0], BASE + case_overrides(n, folder)) for n in names})
    if runs(request, "test_an_expert_parallel_checkpoint_resumes_on_one_process"):
        launches.cases["EP2 saving"] = (2, BASE + EP2 + SAVE + ["--training.local_batch_size", "4"])
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_layout_matches_single_process(name, references, launches, tmp_path):
    nproc, ref_extra, _ = CASES[name]
    reference, tensors = references(tuple(ref_extra))
    result = launches.result(name, tmp_path)
    assert_parity(name, result, reference, tensors)
    assert result["losses"][-1] < result["losses"][0]
    if name in METERED:  # the MoE estimate assumes an even share of routed rows per expert-parallel rank,
        # which the router only approaches: 15% slack for that reason
        check_activation_estimate(result["activation_peaks"]["2"],
                                  load_plan(BASE + case_overrides(name, tmp_path), world_size=nproc), nproc, rel=0.15)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_on_one_process(launches, tmp_path):
    """EP2 x FSDP (2 ranks) saves at step 3 of 6; one process resumes it (DCP reshards the experts, the
    balancing biases come back) and reproduces steps 4-6 of the EP2 run, every tensor."""
    straight = launches.result("EP2 saving", tmp_path)
    single, tensors = record(load_config(overrides=BASE + SAVE + [
        "--training.local_batch_size", "8", "--checkpoint.load_step", "3",
        "--checkpoint.folder", str(straight["dump"] / "checkpoint"), "--job.dump_folder", str(tmp_path / "dump")]))
    assert single.losses == pytest.approx(straight["losses"][3:], rel=1e-5)
    after = {k: v for k, v in straight["tensors"].items()
             if k.startswith(("grad/4/", "grad/5/", "grad/6/", "param/", "buffer/"))}
    cmp = compare(tensors, after)
    REPORT.append(f"{'resume EP2 -> 1 process':<34} worst {cmp.worst_rel:.2e}  {cmp.worst_key}")
    assert cmp.ok, cmp.failures[:10]
