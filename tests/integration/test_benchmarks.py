"""The benchmark scripts are not run in CI (minutes each, figures for docs/performance.md), but each must still
start: its imports (helpers of the trainer it calls by name) and its arguments. One `--help` per script."""

import argparse
import importlib.util
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


def script_parser(script: Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser a script's main() builds, caught at its parse_args (nothing after that runs)."""
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Caught(Exception):
        pass

    def catch(parser, *args, **kwargs):
        raise Caught(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    entry = getattr(module, "main_cli", None) or module.main  # main_cli where the script imports the trainer's main
    with pytest.raises(Caught) as caught:
        entry()
    monkeypatch.undo()
    return caught.value.args[0]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_scripts_counts_are_range_checked(script, monkeypatch, capsys):
    """A count of zero or less (steps, repeats, sizes) is one argparse line naming the option, exit 2, before
    any run: not a StatisticsError traceback after minutes of runs. Every whole-number option is checked."""
    parser = script_parser(script, monkeypatch)
    options = [a for a in parser._actions if a.option_strings and a.type is not None]
    unchecked = [a.option_strings[0] for a in options if a.type is int]
    assert not unchecked, f"{script.name}: {unchecked} take any integer (use arguments.at_least)"
    for action in options:
        minimum = getattr(action.type, "minimum", None)
        if minimum is None:
            continue
        option = action.option_strings[0]
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([option, str(minimum - 1)])
        assert exited.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {option}" in error and f"at least {minimum}" in error, error
    names = {a.dest for a in options}
    if {"steps", "warmup"} <= names:  # the steps after the warm-up are timed: there must be one
        assert "check_timed_steps(" in script.read_text(), f"{script.name} takes --steps at or below --warmup"
