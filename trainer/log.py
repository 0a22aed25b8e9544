"""Logging set-up, importable without torch (``train.py`` configures it before the config is read)."""

import logging
import os
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is logged (it may be replaced after set-up)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def init_logging(level: int = logging.INFO) -> None:
    """Configure the root logger once (later calls change only its level); which ranks print is chosen at
    launch (torchrun filters) and by the level each rank sets."""
    root = logging.getLogger()
    if not any(getattr(h, "_trainer", False) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._trainer = True
        root.addHandler(handler)
    root.setLevel(level)


def init_config_logging() -> None:
    """Before the config is read: its warnings (and the job plan's) are printed once per job, by global rank 0,
    with their label; the other ranks read the same config and would only repeat them. ``trainer.train.main``
    sets every rank's level for the run itself."""
    init_logging(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.ERROR)


class Progress:
    """A long phase's progress as log lines: the first after ``first`` seconds, then at most one every ``every``
    seconds, none for a phase that ends sooner. Lines, not a redrawn bar: they read well in a log file and do not
    flood it (data preparation draws a bar instead when stderr is a terminal)."""

    def __init__(self, what: str, total: int | None = None, *, unit: str = "", first: float = 10.0,
                 every: float = 30.0, clock=None, log: logging.Logger | None = None):
        import time

        self.what, self.total, self.unit, self.first, self.every = what, total, unit, first, every
        self.clock = clock or time.monotonic
        self.log = log or logging.getLogger("trainer.progress")
        self.start = self.last = self.clock()
        self.lines = 0

    def update(self, done: int, detail: str = "") -> None:
        """``done`` units of ``total`` so far; logs a line when one is due."""
        now = self.clock()
        if now - self.last < (self.every if self.lines else self.first):
            return
        self.last, self.lines = now, self.lines + 1
        elapsed = now - self.start
        text = f"{self.what}: {done:,}" + (f"/{self.total:,}" if self.total else "") + f" {self.unit}"
        text += f" after {elapsed:.0f} s"
        if self.total and done:
            text += f", about {elapsed * (self.total - done) / done:.0f} s left"
        self.log.info(text + (f" ({detail})" if detail else ""))
