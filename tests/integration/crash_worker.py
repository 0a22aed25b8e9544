"""Train, but SIGKILL this process in the middle of the save of step ``KILL_AT_STEP``.

    python tests/integration/crash_worker.py sync|async KILL_AT_STEP --overrides...

sync: after DCP has written part of the files (the first write of the step), before the
checkpoint is published. async: right after the background save started.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from trainer.config import load_config  # noqa: E402
from trainer.train import main  # noqa: E402

mode, kill_at, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if mode == "sync":
    real_write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step-{kill_at}.tmp" in str(self.path):
            result = real_write(self, plan, planner)
            result.wait()  # some files are on disk, the metadata is not, nothing is published
            die()
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = write_data
else:
    real_async = dcp.async_save

    def async_save(state, checkpoint_id, **kw):
        future = real_async(state, checkpoint_id=checkpoint_id, **kw)
        if f"step-{kill_at}.tmp" in checkpoint_id:
            die()
        return future

    dcp.async_save = async_save

main(load_config(overrides=overrides))
