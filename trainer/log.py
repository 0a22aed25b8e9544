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
