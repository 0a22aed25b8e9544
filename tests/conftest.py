"""Shared helpers: tiny configs that run in about a second on one CPU core."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # tests must never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(REPO / "tests" / "fixtures"))  # custom model families for registry tests

# A 2-layer, dim-64 Llama with a 512-token vocabulary ...
TINY_MODEL = [
    "--model.overrides.dim", "64", "--model.overrides.n_layers", "2", "--model.overrides.n_heads", "4",
    "--model.overrides.n_kv_heads", "2", "--model.overrides.vocab_size", "512",
]
# ... on 32-token sequences, 4 steps.
TINY_RUN = [
    "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "4",
    "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable_tensorboard", "--debug.deterministic",
]


@pytest.fixture
def tiny_run_args(tmp_path):
    """Overrides for a tiny run (any model) that writes into a temporary dump folder."""
    return TINY_RUN + ["--job.dump_folder", str(tmp_path / "run")]


@pytest.fixture
def tiny_args(tiny_run_args):
    """Overrides for a tiny Llama run."""
    return TINY_MODEL + tiny_run_args


def pytest_terminal_summary(terminalreporter):
    """The worst per-tensor relative difference of every parity case run (tests/parity.py)."""
    from tests.parity import REPORT

    if REPORT:
        terminalreporter.section("parity: worst tensor per case (||a - b|| / ||b||)")
        for line in REPORT:
            terminalreporter.write_line(line)
