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


def load_script(script: Path, monkeypatch):
    """A benchmark script as a module (its imports from beside it found), nothing of it run."""
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_parser(script: Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser a script's main() builds, caught at its parse_args (nothing after that runs)."""
    module = load_script(script, monkeypatch)

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


@pytest.mark.slow
def test_the_planner_benchmark_alternates_every_splits_steps(tmp_path, monkeypatch):
    """bench_pipeline_plan's one launch, on a 5-block model with ZBVZeroBubble (4 splits), one round: every
    split's trainer takes the steps the benchmark's order gives it, numbered as its own (its timeline records
    exactly its measured steps, each from its own split's stages), and the report's figures are those of the
    launch's step times and timelines (medians, the paired ratio against the planner's steps either side)."""
    import json
    import statistics

    from tests.conftest import load_plan

    bench = load_script(REPO / "benchmarks" / "bench_pipeline_plan.py", monkeypatch)
    monkeypatch.setitem(bench.MODELS, "tiny", ["--model.overrides.n_layers", "5", "--training.seq_len", "64",
                                               "--training.local_batch_size", "4"])
    warmup = 1
    args = argparse.Namespace(warmup=warmup, repeats=1, max_splits=20, reuse=False)
    report = bench.run_group("tiny", "ZBVZeroBubble", args, tmp_path)

    order = json.loads((tmp_path / "tiny_ZBVZeroBubble.json").read_text())["order"]
    seconds = json.loads((tmp_path / "tiny_ZBVZeroBubble_steps.json").read_text())
    assert len(seconds) == len(order) and min(seconds) > 0
    rows = report["rows"]
    every = {(a, b - a, c - b, 5 - c) for a in range(1, 4) for b in range(a + 1, 5) for c in range(b + 1, 5)}
    assert {tuple(r["counts"]) for r in rows} == every and len(rows) == len(every) == 4
    planned = load_plan(bench.MODELS["tiny"] + [x.format(steps=10) for x in bench.COMMON]
                        + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]).pipeline.counts
    assert tuple(rows[0]["counts"]) == tuple(planned)  # the planner's split first: the one between the others
    assert order[len(rows) * warmup:] == [0] + [x for i in order[len(rows) * warmup + 1::2] for x in (i, 0)]
    assert sorted(order[len(rows) * warmup + 1::2]) == list(range(1, len(rows)))  # each other split once a round

    measured = {i: [] for i in range(len(rows))}
    seen = [0] * len(rows)
    sequence = []  # (run, seconds) of the measured steps, in launch order
    for i, t in zip(order, seconds):
        seen[i] += 1
        if seen[i] > warmup:
            measured[i].append(t)
            sequence.append((i, t))
    for i, row in enumerate(rows):
        counts = tuple(row["counts"])
        traces = sorted((tmp_path / f"tiny_ZBVZeroBubble_{i}" / "profile_traces").glob("pipeline_timeline_step*.json"),
                        key=lambda f: int(f.stem.removeprefix("pipeline_timeline_step")))
        steps = [int(f.stem.removeprefix("pipeline_timeline_step")) for f in traces]
        assert steps == list(range(warmup + 1, order.count(i) + 1)), (counts, steps)
        bubbles = []
        for f in traces:
            trace = json.loads(f.read_text())
            forwards = [e["args"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "F"]
            assert {a["stage"]: len(a["blocks_ms"]) for a in forwards} == dict(enumerate(counts)), (counts, f.name)
            bubbles.append(trace["otherData"]["bubble"])
        assert row["measured"] == [statistics.median(b[str(r)] for b in bubbles) for r in range(2)]
        assert row["step"] == statistics.median(measured[i])
        if i:  # one step each: no halves to compare
            assert row["halves_apart"] is None
        else:  # the planner's steps: the median bubble of the 1st and 3rd against the 2nd and 4th
            assert len(bubbles) == 4
            halves = [[statistics.median(b[str(r)] for b in bubbles[k::2]) for r in range(2)] for k in (0, 1)]
            apart = [abs(a - b) for a, b in zip(*halves)]
            assert row["halves_apart"] == pytest.approx(apart)
            assert report["bubble_halves_apart"] == pytest.approx((50 * sum(apart), 100 * max(apart)))
        assert all(0 <= b < 1 for b in row["before"] + row["after"])
        if i:
            k = next(k for k, (j, _) in enumerate(sequence) if j == i)
            beside = (sequence[k - 1][1] + sequence[k + 1][1]) / 2
            assert sequence[k - 1][0] == sequence[k + 1][0] == 0
            assert row["paired"] == pytest.approx(sequence[k][1] / beside)
    assert (tmp_path / "tiny_ZBVZeroBubble_all_boundaries" / "pipeline_costs.json").is_file()
