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


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_finds_the_trainer_from_a_checkout(script):
    """A GPU machine runs the scripts from a copy of the checkout, the trainer not installed: a script that imports
    the trainer at its top level puts the repository on sys.path first (here the trainer is installed, so `--help`
    alone would not tell)."""
    import ast

    body = ast.parse(script.read_text()).body
    first_import = next((i for i, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (getattr(node, "module", None) or alias.name).split(".")[0] == "trainer" for alias in node.names)), None)
    if first_import is None:
        return
    inserts = [i for i, node in enumerate(body) if "sys.path.insert" in ast.unparse(node)]
    assert inserts and inserts[0] < first_import, f"{script.name} imports the trainer before sys.path has the repo"
