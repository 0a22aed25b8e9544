"""Asynchronous checkpoints with several ranks (issue 66): saves in the background at every step while training goes
on, under each layout, and a resume from one of them gives the uninterrupted run bit for bit.

Before the saves had a process group of their own, FSDP2 with async saves at interval 1 aborted (gloo: collective
mismatch, lost peer) or deadlocked at the first background save.
"""

import pytest

from tests.distributed.harness import Launches, P, PARITY, selected
from tests.parity import compare
from trainer.checkpoint import complete_steps

STEPS = 4
RESUME_AT = 2
SAVES = ["--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", str(STEPS)]

LAYOUTS = {
    "FSDP2": (2, [P + "data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    "DDP2": (2, [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1",
                 "--training.local_batch_size", "4"]),
    "TP2": (2, [P + "tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "PP2-ZBV": (2, ["--model.overrides.n_layers", "4", P + "pipeline_parallel_degree", "2",
                    P + "pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "8"]),
    "PP2xFSDP2-ZBV": (4, ["--model.overrides.n_layers", "4", P + "pipeline_parallel_degree", "2",
                          P + "data_parallel_shard_degree", "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble",
                          "--training.local_batch_size", "4"]),
}
# (layout, async_mode); without CUDA async_with_pinned_mem saves as async (said once), so one layout covers it here.
CASES = [(layout, "async") for layout in LAYOUTS] + [("FSDP2", "async_with_pinned_mem")]


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """Per case, two runs in the shared launch of its rank count: the straight run, saving in the background at every
    step; then a run that resumes from the straight run's step-2 checkpoint (written while step 3 trained)."""
    folder = tmp_path_factory.mktemp("async_save")
    cases = {}
    for params in selected(request, "test_a_resume_from_a_background_save_is_exact"):
        layout, mode = params["layout"], params["mode"]
        nproc, overrides = LAYOUTS[layout]
        args = [*PARITY, *overrides, *SAVES, "--checkpoint.async_mode", mode]
        cases[f"{layout}-{mode}"] = (nproc, args)
        straight_dump = folder / f"case{len(cases) - 1}_dump"  # Launches' folder of the case just added
        cases[f"{layout}-{mode}-resumed"] = (nproc, args + [
            "--checkpoint.folder", str(straight_dump / "checkpoint"), "--checkpoint.load_step", str(RESUME_AT)])
    return Launches(folder, cases)


@pytest.mark.slow
@pytest.mark.parametrize("layout, mode", CASES)
def test_a_resume_from_a_background_save_is_exact(layout, mode, launches, tmp_path):
    straight = launches.result(f"{layout}-{mode}", tmp_path)
    # Every step's save was published (the last one in the foreground), each while the next step trained.
    assert complete_steps(straight["dump"] / "checkpoint") == list(range(1, STEPS + 1))
    resumed = launches.result(f"{layout}-{mode}-resumed", tmp_path)
    assert resumed["losses"] == straight["losses"][RESUME_AT:]
    assert resumed["grad_norms"] == straight["grad_norms"][RESUME_AT:]
    # Every gradient of the steps after the resume and every final parameter, per tensor, bit for bit.
    later = tuple(f"grad/{s}/" for s in range(RESUME_AT + 1, STEPS + 1)) + ("param/",)
    after = {k: v for k, v in straight["tensors"].items() if k.startswith(later)}
    assert after and any(k.startswith("grad/") for k in after)
    same = compare(resumed["tensors"], after, rtol=0.0, floor=0.0)
    assert same.ok, same.failures[:10]


TIMEOUT = 5  # [comm] train_timeout_seconds
GRACE = 40  # after the fault: torchrun stops the other ranks with SIGTERM and kills them 30 s later, plus 10 s


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die", "hang", "disk_full"])
def test_a_fault_during_a_background_save_ends_the_job_and_keeps_the_previous_checkpoint(fault, tmp_path):
    """FSDP2, saves at steps 2 and 4 in the background; step-4's save is slowed by 2 s on every rank and rank 1
    fails at step 5, while it runs (die: SIGKILL; hang: SIGSTOP) or its write fails (disk_full: ENOSPC). The job
    ends within the timeout, without a traceback; step-4 is never published and step-2 resumes in one process."""
    import time

    from tests.distributed.harness import REPO, seconds_after_fault, torchrun
    from trainer.config import load_config
    from trainer.train import main

    common = [*PARITY, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2",
              "--checkpoint.async_mode", "async", "--comm.train_timeout_seconds", str(TIMEOUT),
              "--job.dump_folder", str(tmp_path)]
    run = common + LAYOUTS["FSDP2"][1]
    proc = torchrun(2, [str(REPO / "tests" / "distributed" / "fault_worker.py"), *run], tmp_path, timeout=300,
                    env={"FAULT": fault, "FAULT_STEP": "5", "SLOW_SAVE": "step-4:2"})
    output = proc.stdout + proc.stderr
    elapsed = seconds_after_fault(output, time.time())
    assert elapsed < TIMEOUT + GRACE, f"ended {elapsed:.0f} s after the fault"
    assert "Traceback" not in output, output[-3000:]
    summary = [line for line in output.splitlines() if "failed first" in line]
    assert len(summary) == 1, output[-3000:]
    if fault == "die":
        assert proc.returncode == 1 and summary[0].startswith("error: rank 1 failed first (killed (SIGKILL))")
    elif fault == "hang":  # the survivor's watchdog gives up; the stopped rank is the one the launcher kills
        assert proc.returncode == 1 and summary[0].startswith("error: rank 0 failed first (exit status 1)")
        assert "error: rank 0: no training progress for 5 s" in output, output[-3000:]
    else:  # every rank learns of rank 1's failed write from DCP and stops with the same line
        assert proc.returncode == 2, output[-3000:]
        errors = [line for line in output.splitlines() if "could not save step-4" in line]
        assert len(errors) == 2 and all("No space left on device" in line for line in errors), output[-3000:]
    folder = tmp_path / "checkpoint"
    assert complete_steps(folder) == [2], sorted(p.name for p in folder.iterdir())
    if fault == "disk_full":  # the failed save's partial folder is removed
        assert not (folder / "step-4.tmp").exists()
    resumed = main(load_config(overrides=common + ["--training.local_batch_size", "8", "--training.steps", "3"]))
    assert len(resumed.losses) == 1  # step 3, from step-2
