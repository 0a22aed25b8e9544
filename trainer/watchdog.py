"""A per-rank watchdog: a rank that makes no progress for ``[comm] train_timeout_seconds`` ends.

Collective timeouts do not cover everything: on gloo, a pipeline rank waiting to receive from a
peer that stopped answering (a stopped or stuck process, not a dead one) waits on the timeout
its group was created with, not the train timeout, and the wait of a functional collective (expert
parallelism's all-to-all) was seen to ignore the group's timeout altogether. The watchdog covers any
such wait: if no progress is made within the timeout, this rank prints one line and exits, and the
launcher then ends the job. The first step (warm-up: compilation, pipeline shape inference) is
bounded by ``[comm] init_timeout_seconds``, every later one by the train timeout.
"""

import contextlib
import os
import sys
import threading
import time


class Watchdog:
    def __init__(self, timeout_seconds: float, rank: int):
        self.timeout, self.rank = timeout_seconds, rank
        self.key = "[comm] train_timeout_seconds"
        self._last = time.monotonic()
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress was made (a microbatch, a pipeline step, a phase of the step, a step)."""
        self._last = time.monotonic()

    def arm(self, timeout_seconds: float | None = None, key: str = "[comm] train_timeout_seconds") -> None:
        """Start watching with ``timeout_seconds`` (default: the one given at construction), the config ``key``
        that sets it named in the message."""
        self.timeout = timeout_seconds if timeout_seconds is not None else self.timeout
        self.key = key
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
        # Sleeps until the deadline itself (not in fixed ticks, which made it fire up to 1 s late, after a
        # collective's own timeout of the same length had already ended the rank without this message).
        while True:
            if self._armed:
                remaining = self._last + self.timeout - time.monotonic()
                if remaining < 0:
                    print(f"error: rank {self.rank}: no training progress for {self.timeout:g} s (a peer rank is"
                          f" probably stuck or dead); raise {self.key} if a step legitimately takes longer",
                          file=sys.stderr, flush=True)
                    os._exit(1)  # the main thread is blocked in a wait that nothing else will end
                wait = remaining + 0.001
            else:
                wait = min(1.0, self.timeout / 4)
            if self._stop.wait(wait):
                return
