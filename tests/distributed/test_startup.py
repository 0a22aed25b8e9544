"""A job start plans once: the meta model is built once for the plan and once per chunk, and an
automatic TP plan is derived once, on every rank of a PP x TP job."""

import json

import pytest

from tests.distributed.harness import PARITY, REPO, failure_report, torchrun


@pytest.mark.slow
def test_pp_x_tp_start_builds_the_model_once_per_chunk_plus_the_plan(tmp_path):
    out = tmp_path / "counts.json"
    P = "--parallelism."
    args = [str(REPO / "tests" / "distributed" / "count_worker.py"), str(out), *PARITY,
            "--model.overrides.n_layers", "4", "--training.steps", "1", "--training.local_batch_size", "8",
            P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", "Interleaved1F1B",
            P + "tensor_parallel_degree", "2", P + "tensor_parallel_plan", "auto", P + "no-enable_sequence_parallel",
            "--job.dump_folder", str(tmp_path / "dump")]
    proc = torchrun(4, args, tmp_path)
    assert proc.returncode == 0, failure_report(proc, tmp_path)
    for rank in range(4):
        counts = json.loads(out.with_name(f"counts.json.rank{rank}").read_text())
        assert counts["chunks"] == 2  # Interleaved1F1B: two stages per rank
        assert counts["builds"] == counts["chunks"] + 1, counts
        assert counts["derivations"] == 1, counts
