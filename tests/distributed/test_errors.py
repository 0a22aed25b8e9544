"""User errors in a multi-process job: every rank exits with the same one-line message, none hangs."""

import re

import pytest

from tests.distributed.harness import REPO, torchrun

CASES = [
    (["--parallelism.tensor_parallel_degree", "4"], "tp 4 * pp 1 = 4 does not divide WORLD_SIZE 2"),
    (["--parallelism.data_parallel_shard_degree", "4"], "= 4 != WORLD_SIZE 2"),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", "--model.overrides.n_kv_heads", "1"],
     "tensor_parallel_degree=2 must divide model n_kv_heads=1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", CASES, ids=[c[1][:30] for c in CASES])
def test_every_rank_reports_the_same_error(tmp_path, args, message):
    proc = torchrun(2, [str(REPO / "train.py"), "--job.dump_folder", str(tmp_path), *args], tmp_path, timeout=120)
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if re.match(r"(\[rank\d\]:)?error: \[", line)]
    # Every rank that got to report says the same; torchrun may stop the slower one first.
    assert 1 <= len(errors) <= 2, output[-3000:]
    assert all(message in line for line in errors)
    assert "Traceback" not in output
    # The launcher's summary names the rank that failed first and its status.
    assert re.search(r"error: rank [01] failed first \(exit status 2\); .*see rank [01]'s output above", output)
