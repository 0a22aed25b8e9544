"""The benchmark scripts are not run in CI (minutes each, figures for docs/performance.md), but each must still
start: its imports (helpers of the trainer it calls by name) and its arguments. One `--help` per script, all of them
in one fresh interpreter (one import of torch, not one per script)."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "benchmarks").glob("bench_*.py"))


def test_every_benchmark_script_is_listed():
    assert len(SCRIPTS) >= 15  # the glob found the folder


# Runs each script given as `python SCRIPT --help` would (its folder first on sys.path, run as __main__); prints
# {script: [exit code or traceback, what it printed]} as JSON.
HELP_EACH = """
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for script in sys.argv[1:]:
    printed, path = io.StringIO(), list(sys.path)
    sys.argv, sys.path[0:0] = [script, "--help"], [os.path.dirname(script)]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc()
    sys.path[:] = path
    results[script] = [code, printed.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps():
    proc = subprocess.run([sys.executable, "-c", HELP_EACH, *map(str, SCRIPTS)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_a_benchmark_script_starts(script, helps):
    code, printed = helps[str(script)]
    assert code == 0, code
    assert "usage:" in printed


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


def test_the_planner_benchmark_bands_each_calibrations_error_by_its_own_prediction(monkeypatch):
    """The signed-error table: each rank-split counted in the band of the prediction it is judged against, measured
    minus predicted in points."""
    bench = load_script(REPO / "benchmarks" / "bench_pipeline_plan.py", monkeypatch)
    assert bench.WAIT_BANDS == ((0.0, 0.15), (0.15, 0.30), (0.30, 1.0))
    rows = [{"measured": [0.25, 0.40], "after": [0.10, 0.35], "before": [0.20, 0.36]},
            {"measured": [0.05, 0.50], "after": [0.00, 0.50], "before": [0.20, 0.20]}]
    after = bench.bias_by_wait(rows)  # +15 and +5 under 15%; +5 and 0 over 30%
    assert [n for _, n in after] == [2, 0, 2] and after[0][0] == pytest.approx(10)
    assert after[2][0] == pytest.approx(2.5)
    assert after[1][0] != after[1][0]  # no rank-split: NaN, printed "none"
    before = bench.bias_by_wait(rows, "before")  # +5, -15 and +30 in 15-30%, +4 over 30%
    assert [n for _, n in before] == [0, 3, 1] and before[1][0] == pytest.approx(20 / 3)
    assert before[2][0] == pytest.approx(4)


def test_the_planner_benchmark_pools_earlier_reports(tmp_path, monkeypatch, capsys):
    """--pool: the signed errors of every rank-split of every group, per model and prediction, each banded by its
    own prediction."""
    import json

    bench = load_script(REPO / "benchmarks" / "bench_pipeline_plan.py", monkeypatch)

    def group(schedule, measured, after):
        rows = [{"measured": m, "before": [0.2, 0.2], "one_device": [0.5, 0.5], "after": a}
                for m, a in zip(measured, after)]
        return {"model": "tiny", "schedule": schedule, "rows": rows}

    (tmp_path / "a.json").write_text(json.dumps([group("A", [[0.15, 0.30]], [[0.05, 0.40]])]))
    (tmp_path / "b.json").write_text(json.dumps([
        group("B", [[0.12, 0.44], [0.05, 0.50]], [[0.10, 0.40], [0.10, 0.55]]),
        group("C", [[0.20, 0.20]], [[0.20, 0.20]]), group("D", [[0.20, 0.20]], [[0.20, 0.20]]),
        group("E", [], [])]))  # no split measured
    bench.pool([tmp_path / "a.json", tmp_path / "b.json"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    # measured minus predicted, points, per band (under 15%, 15-30%, over 30%):
    # before (0.2 everywhere: 15-30%): A -5 +10, B -8 +24 -15 +30, C 0 0, D 0 0: mean 3.6 over 10, no group negative
    # one device (0.5: over 30%): A -35 -20, B -38 -6 -45 0, C -30 -30, D -30 -30: mean -26.4, every group negative
    # calibrated: A +10 | -10; B +2 -5 | +4 -5 (B's means -1.5 and -0.5); C and D 0 0 in 15-30%
    assert rows == ["| tiny | before calibration (the FLOP model) | none | +3.60 (10), 0 of 4 | none |",
                    "| tiny | parts timed on one device | none | none | -26.40 (10), 4 of 4 |",
                    "| tiny | calibrated from the timed run | +2.33 (3), 1 of 2 | +0.00 (4), 0 of 2"
                    " | -3.67 (3), 2 of 2 |"]
    # a report of an older version (no one-device figures): one line naming the option, exit 2
    (tmp_path / "old.json").write_text(json.dumps([{"model": "tiny", "schedule": "A", "rows": [
        {"measured": [0.1, 0.2], "before": [0.2, 0.2], "after": [0.1, 0.2]}]}]))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pipeline_plan.py"), "--pool",
                           str(tmp_path / "old.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--pool: a report this version of the benchmark did not write" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pipeline_plan.py"), "--pool",
                           str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"--pool: {tmp_path / 'none.json'}: No such file" in proc.stderr
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pipeline_plan.py"), "--pool",
                           str(tmp_path / "a.json"), "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--pool runs nothing, so --json would do nothing" in proc.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_the_planner_benchmark_alternates_every_splits_steps(tmp_path, monkeypatch, launch_tmp):
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
    args = argparse.Namespace(warmup=warmup, repeats=1, max_splits=20, reuse=False, memory_bytes_per_second=5e9)
    for name, value in launch_tmp.env.items():
        monkeypatch.setenv(name, value)
    report = bench.run_group("tiny", "ZBVZeroBubble", args, tmp_path)
    assert not launch_tmp.left()  # torchrun's logs go with the benchmark's files

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
    # the signed error by predicted wait, of the calibration's predictions
    for (low, high), (mean, n) in zip(bench.WAIT_BANDS, report["bias_by_wait"], strict=True):
        errors = [100 * (r["measured"][k] - r["after"][k]) for r in rows for k in range(2)
                  if low <= r["after"][k] < high]
        assert n == len(errors), low
        assert mean == pytest.approx(statistics.mean(errors)) if errors else mean != mean, low
    # the memory model's column: the FLOP model at the block's one-device FLOP rate with the bytes at 5 GB/s
    from trainer.pipeline.search import Simulator
    from trainer.pipeline.simulate import program_for

    job = report["job"] + ["--parallelism.pipeline_parallel_device_tflops", "1"]
    flops = statistics.fmean(load_plan(job).pipeline_costs.parts["F"][1:-1])
    timed = json.loads((tmp_path / "tiny_ZBVZeroBubble_one_device.json").read_text())["measured"]["parts_s"]["F"]
    tflops = flops / statistics.fmean(timed[1:-1])
    assert report["memory_rates"] == pytest.approx((tflops, 5.0))
    at = report["job"] + ["--parallelism.pipeline_parallel_device_tflops", repr(tflops),
                          "--training.mixed_precision_param", "float32"]
    program = program_for("ZBVZeroBubble", 2, load_plan(at).n_microbatches, 2)
    sims = [Simulator(load_plan(at + more).pipeline_costs, program) for more in
            (["--parallelism.pipeline_parallel_device_memory_gbytes_per_second", "5"], [])]
    moved = False
    for r in rows:
        with_bytes, without = ([sim.predict(tuple(r["counts"])).bubble(k) for k in range(2)] for sim in sims)
        assert r["before_memory"] == pytest.approx(with_bytes) and r["before_seconds"] == pytest.approx(without)
        moved = moved or with_bytes != pytest.approx(without, abs=1e-6)
    assert moved  # the bytes move the prediction


def test_the_part_table_adds_each_parts_bytes_once(monkeypatch):
    """bench_pipeline_costs' part table with the memory model: a block's forward takes 1 s (the unit); at 2 bytes/s
    the embedding's 2 bytes add 1 block to its W and so to its B, the loss's 4 forward bytes 2 blocks to the output's
    F, its 6 input-gradient bytes 3 blocks to the output's I and B (B = I + W: the forward's bytes are not in it)."""
    costs = load_script(REPO / "benchmarks" / "bench_pipeline_costs.py", monkeypatch)
    seconds = {"F": [0.1, 1.0, 1.0, 2.0], "B": [0.2, 2.0, 2.0, 4.0], "I": [0.0, 1.5, 1.5, 3.0],
               "W": [0.2, 0.5, 0.5, 1.0]}
    units = argparse.Namespace(parts={"F": [0, 1, 1, 3], "B": [0, 2, 2, 6], "I": [0, 1, 1, 3], "W": [0, 1, 1, 3]})
    rows = costs.part_table("m", seconds, units, {"pre W": 2.0, "post F": 4.0, "post I": 6.0}, 2.0)
    assert [r.split(" | ", 2)[2] for r in rows] == [  # after "| m | kind"
        "100.000 ms (0.10 / 0.00 / 0.00) | 1000.000 ms (1.00 / 1.00 / 1.00) | 2000.000 ms (2.00 / 3.00 / 5.00) |",
        "200.000 ms (0.20 / 0.00 / 1.00) | 2000.000 ms (2.00 / 2.00 / 2.00) | 4000.000 ms (4.00 / 6.00 / 9.00) |",
        "0.000 ms (0.00 / 0.00 / 0.00) | 1500.000 ms (1.50 / 1.00 / 1.00) | 3000.000 ms (3.00 / 3.00 / 6.00) |",
        "200.000 ms (0.20 / 0.00 / 1.00) | 500.000 ms (0.50 / 1.00 / 1.00) | 1000.000 ms (1.00 / 3.00 / 3.00) |"]
    assert [r.split(" | ", 2)[1] for r in rows] == ["F", "B", "I", "W"]
    assert costs.part_table("m", seconds, units)[0] == (
        "| m | F | 100.000 ms (0.10 / 0.00) | 1000.000 ms (1.00 / 1.00) | 2000.000 ms (2.00 / 3.00) |")


def test_the_sleep_models_cost_what_the_flop_model_prices(monkeypatch):
    """bench_pipeline_plan's sleep models (benchmarks/sleep_model.py) measure the simulation alone only if the FLOP
    model prices them exactly: each part's F, I and W are its milliseconds over the mean block's. And torch's split
    backward must find each sleep where the FLOP model puts it: the input's gradient runs the input's sleep alone,
    the weight's gradient the weight's alone, the whole backward both (sleeps recorded, not timed)."""
    import statistics
    from types import SimpleNamespace

    import torch

    from tests.conftest import load_plan

    bench = load_script(REPO / "benchmarks" / "bench_pipeline_plan.py", monkeypatch)  # benchmarks/ on sys.path
    import sleep_model

    for name in ("sleep", "sleep_unequal"):
        plan = load_plan(bench.MODELS[name] + [a.format(steps=10) for a in bench.COMMON]
                         + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 2)
        a = plan.model_args
        blocks = [a.block_ms[i % len(a.block_ms)] for i in range(a.n_layers)]
        mean = statistics.fmean(blocks)
        expected = [0.0, *(ms / mean for ms in blocks), a.post_ms / mean]  # the embedding: no sleep
        for kind in ("F", "I", "W"):
            assert plan.pipeline_costs.parts[kind] == pytest.approx(expected, rel=1e-4), (name, kind)

    slept = []
    monkeypatch.setattr(sleep_model, "time", SimpleNamespace(sleep=slept.append))
    part = sleep_model.SleepPart(4, 5.0)
    torch.nn.init.ones_(part.weight)
    x = torch.ones(1, 3, 4, requires_grad=True)
    y = part(x).sum()
    assert slept == [0.005]  # F: the input's path; the weight's is free in the forward
    for inputs, sleeps in (([x], 1), ([part.weight], 1), ([x, part.weight], 2)):
        slept.clear()
        torch.autograd.grad(y, inputs, retain_graph=True)
        assert slept == [0.005] * sleeps, inputs
