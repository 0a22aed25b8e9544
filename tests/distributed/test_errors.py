"""User errors in a multi-process job: every rank exits with the same one-line message, none hangs."""

import re

import pytest

from tests.distributed.harness import PARITY, REPO, WORKER, torchrun

CASES = [
    (["--parallelism.tensor_parallel_degree", "4"], "tp 4 * pp 1 = 4 does not divide WORLD_SIZE 2"),
    (["--parallelism.data_parallel_shard_degree", "4"], "= 4 != WORLD_SIZE 2"),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", "--model.overrides.n_kv_heads", "1"],
     "tensor_parallel_degree=2 must divide model n_kv_heads=1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", CASES, ids=[c[1][:30] for c in CASES])
def test_every_rank_reports_the_same_error(tmp_path, args, message, launch_tmp):
    proc = torchrun(2, [str(REPO / "train.py"), "--job.dump_folder", str(tmp_path), *args], tmp_path, timeout=120,
                    env=launch_tmp.env)
    # the launcher leaves no folder of torchrun's behind (it has nothing in it without --log-dir or redirects)
    assert not launch_tmp.left()
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if re.match(r"(\[rank\d\]:)?error: \[", line)]
    # Every rank that got to report says the same; torchrun may stop the slower one first.
    assert 1 <= len(errors) <= 2, output[-3000:]
    assert all(message in line for line in errors)
    assert "Traceback" not in output
    # The launcher's summary names the rank that failed first and its status.
    assert re.search(r"error: rank [01] failed first \(exit status 2\); .*see rank [01]'s output above", output)


@pytest.mark.slow
def test_ranks_that_opened_different_data_stop_with_one_line(tmp_path):
    """The same-data check at start: rank 1 reports another dataset digest (tests/distributed/worker.py)."""
    args = [str(WORKER), str(tmp_path / "out.json"), *PARITY, "--job.dump_folder", str(tmp_path / "dump"),
            "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]
    proc = torchrun(2, args, tmp_path, timeout=120, env={"PARITY_FAULT": "other_data_on_rank1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "error: [training] dataset: ranks [1] opened other data or another tokenizer than rank 0" in output
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("fault, extra, fragments", [
    ("other_config_on_rank1", ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
     ["error: [training] steps: ranks [1] have 5 where rank 0 has 3 (another config file or command line"]),
    # 4 blocks over 2 stages: three splits; rank 1 keeps the second best, rank 0 the best
    ("other_planner_on_rank1", ["--model.overrides.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2"],
     ["error: [parallelism] pipeline_parallel_split_points: ranks [1] planned the split [",
      "] from the same config and files as rank 0", "pipeline_parallel_split_points = [\"layers."]),
    # the same, rank 1 searching within half the memory (pipeline_parallel_memory_limit_gib 0: each rank's device)
    ("smaller_device_on_rank1", ["--model.overrides.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2"],
     ["error: [parallelism] pipeline_parallel_memory_limit_gib: ranks [1] planned the split [",
      "] within their device's memory of ", " (0 = each rank's own device)"]),
], ids=["config", "split", "memory"])
def test_ranks_that_would_run_another_job_stop_with_one_line(tmp_path, fault, extra, fragments):
    """The same-plan check at start (trainer/agreement.py): rank 1 loads another config, or plans another split
    from the same config (tests/distributed/worker.py); both ranks stop before building anything."""
    args = [str(WORKER), str(tmp_path / "out.json"), *PARITY, "--job.dump_folder", str(tmp_path / "dump"), *extra]
    proc = torchrun(2, args, tmp_path, timeout=120, env={"PARITY_FAULT": fault})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error: [" in line]
    assert errors and all(f in line for line in errors for f in fragments), output[-3000:]
    assert "Traceback" not in output
    assert not (tmp_path / "dump" / "config.toml").exists(), "the check runs before the trainer is built"
