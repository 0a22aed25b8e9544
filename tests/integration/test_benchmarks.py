"""The benchmark scripts are not run in CI (minutes each, figures for docs/performance.md), but each must still
start: its imports (helpers of the trainer it calls by name) and its arguments. One `--help` per script."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "benchmarks").glob("bench_*.py"))


def test_every_benchmark_script_is_listed():
    assert len(SCRIPTS) >= 15  # the glob found the folder


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_starts(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
