"""Run under torchrun: the real entry point (train.py's ``run``), with one rank failing at step 3 (or FAULT_STEP).

    FAULT=die|hang|stall torchrun --nproc_per_node 2 tests/distributed/fault_worker.py --section.key value ...
die: rank 1 kills itself (SIGKILL). hang: rank 1 stops itself (SIGSTOP) and never answers again, not even
torchrun's SIGTERM (it is killed 30 s later). stall: rank 1 waits forever in Python; it never answers
its peers, and a SIGTERM ends it. disk_full: rank 1's write of checkpoint SLOW_SAVE's step fails with ENOSPC.

SLOW_SAVE=NAME:SECONDS makes every rank's write of checkpoint NAME (step-4, say) take SECONDS longer, so that a
fault at the next step lands while that save runs in the background.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trainer.train as train_mod  # noqa: E402
from train import run  # noqa: E402

real_step = train_mod.train_step


def say_fault() -> None:
    """The time of the fault, for the tests' bound on how long the job takes to end after it (not after a start-up
    that is slow under load)."""
    print(f"fault_worker: fault at {time.time():.3f}", file=sys.stderr, flush=True)
calls = {"n": 0}


def failing_step(*args, **kwargs):
    calls["n"] += 1
    if (calls["n"] == int(os.environ.get("FAULT_STEP", "3")) and os.environ.get("RANK") == "1"
            and os.environ["FAULT"] != "disk_full"):
        say_fault()
        if os.environ["FAULT"] == "stall":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL if os.environ["FAULT"] == "die" else signal.SIGSTOP)
    return real_step(*args, **kwargs)


train_mod.train_step = failing_step

if os.environ.get("SLOW_SAVE"):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    slow_name, seconds = os.environ["SLOW_SAVE"].split(":")
    real_write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"{slow_name}.tmp" in str(self.path):
            time.sleep(float(seconds))
            if os.environ.get("FAULT") == "disk_full" and os.environ.get("RANK") == "1":
                say_fault()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = write_data
sys.exit(run(sys.argv[1:]))
