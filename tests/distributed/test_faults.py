"""A dead or hung rank ends the job within the train timeout plus the launcher's grace period,
with one summary line; the surviving rank prints one line, not a traceback."""

import re
import time

import pytest

from tests.distributed.harness import PARITY, REPO, seconds_after_fault, torchrun

TIMEOUT = 5  # [comm] train_timeout_seconds
GRACE = 40  # after the fault: torchrun stops the other ranks with SIGTERM and kills them 30 s later, plus 10 s


LAYOUTS = {
    "PP2": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"],
    "FSDP2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
}


# hang (SIGSTOP) costs torchrun's fixed 30 s before SIGKILL; stall exercises the same watchdog with a rank
# that a SIGTERM ends at once.
@pytest.mark.slow
@pytest.mark.parametrize("fault, layout", [("die", "PP2"), ("die", "FSDP2"), ("hang", "PP2"), ("stall", "FSDP2")])
def test_a_dead_or_hung_rank_ends_the_job(fault, layout, tmp_path):
    args = [str(REPO / "tests" / "distributed" / "fault_worker.py"), *PARITY, "--model.overrides.n_layers", "4",
            "--training.steps", "50", *LAYOUTS[layout], "--comm.train_timeout_seconds", str(TIMEOUT),
            "--job.dump_folder", str(tmp_path)]
    proc = torchrun(2, args, tmp_path, timeout=300, env={"FAULT": fault})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    elapsed = seconds_after_fault(output, time.time())
    assert elapsed < TIMEOUT + GRACE, f"ended {elapsed:.0f} s after the fault"
    summary = [line for line in output.splitlines() if "failed first" in line]
    assert len(summary) == 1, output[-3000:]
    if fault == "die":  # the dead rank failed first
        assert summary[0].startswith("error: rank 1 failed first (killed (SIGKILL))")
    elif fault == "hang":  # the survivor timed out first; the stopped rank is the one the launcher had to kill
        assert summary[0].startswith("error: rank 0 failed first (exit status 1); rank 1: killed (SIGKILL)")
    else:  # a stalled rank's own watchdog also fires: whichever rank gave up first is named
        assert re.match(r"error: rank [01] failed first \(exit status 1\)", summary[0]), summary
    assert "Traceback" not in output, output[-3000:]
    if fault != "die":  # a rank says why it gave up, in one line
        assert re.search(r"error: rank [01]: (no training progress for 5 s|lost contact with another rank)", output)


@pytest.mark.slow
def test_a_rank_hung_in_the_first_step_ends_the_job_within_the_init_timeout(tmp_path):
    """Rank 1 stalls before its first step of an expert-parallel run (whose all-to-all waits were seen to ignore
    the group timeout): the first step is bounded by [comm] init_timeout_seconds, not left to hang."""
    from tests.distributed.test_moe_parity import BASE, EP2

    args = [str(REPO / "tests" / "distributed" / "fault_worker.py"), *BASE, "--training.steps", "50", *EP2,
            "--training.local_batch_size", "4", "--comm.init_timeout_seconds", str(TIMEOUT),
            "--comm.train_timeout_seconds", "100", "--job.dump_folder", str(tmp_path)]
    proc = torchrun(2, args, tmp_path, timeout=300, env={"FAULT": "stall", "FAULT_STEP": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    elapsed = seconds_after_fault(output, time.time())
    assert elapsed < TIMEOUT + GRACE, f"ended {elapsed:.0f} s after the fault"
    assert "Traceback" not in output, output[-3000:]
    # the stalled rank's own watchdog (or its peer's) gives up on the first step, naming the init timeout's key
    assert re.search(r"error: rank [01]: no training progress for 5 s .*init_timeout_seconds", output), output[-3000:]
