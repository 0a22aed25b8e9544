"""A per-rank watchdog: a rank that makes no progress for ``[comm] train_timeout_seconds`` ends.

Collective timeouts do not cover everything: on gloo, a pipeline rank waiting to receive from a
peer that stopped answering (a stopped or stuck process, not a dead one) waits on the timeout
its group was created with, not the train timeout. The watchdog covers any such wait: once
training runs, if no step completes within the timeout, this rank prints one line and exits,
and the launcher then ends the job.
"""

import contextlib
import os
import sys
import threading
import time


class Watchdog:
    def __init__(self, timeout_seconds: float, rank: int):
        self.timeout, self.rank = timeout_seconds, rank
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress was made (a microbatch, a pipeline step, a phase of the step, a step)."""
        self._last = time.monotonic()

    def arm(self) -> None:
        """Start watching (after the first step: set-up and warm-up are not bounded by the timeout)."""
        self._last = time.monotonic()
        self._armed = True

    @contextlib.contextmanager
    def paused(self):
        """For work whose length is not bounded by the step time (checkpoint saves)."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._last, self._armed = time.monotonic(), armed

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if self._armed and time.monotonic() - self._last > self.timeout:
                print(f"error: rank {self.rank}: no training progress for {self.timeout:g} s (a peer rank is probably"
                      " stuck or dead); raise [comm] train_timeout_seconds if a step legitimately takes longer",
                      file=sys.stderr, flush=True)
                os._exit(1)  # the main thread is blocked in a wait that nothing else will end
