"""The pipeline planner against measurement: the step of every contiguous split, PP2 on CPU.

    python benchmarks/bench_pipeline_plan.py                     # both models, four schedules
    python benchmarks/bench_pipeline_plan.py --models debug --schedules ZBVZeroBubble

For each model (the 6-block debug model; a 12-block Llama with a 32k vocabulary, whose output
projection costs about ten blocks) and schedule (1F1B, Interleaved1F1B, ZBVZeroBubble,
DualPipeV at pp 2), one torchrun launch trains every contiguous split the schedule allows (where
there are more than --max-splits, the best 10 by the planner's prediction plus 10 random ones),
each for --steps steps with the pipeline timeline on the steps after --warmup, after a discarded
warm-up case, in --repeats passes, each in a seeded shuffled order, with the planner's own split
after every case (a split's figures are the medians over its cases of each case's median over its
timed steps). The planner's split also runs first; its timeline's measured costs
(pipeline_costs.json) calibrate the predictions of every other split. This machine's speed drifts
over a launch (the 32k-vocabulary output part ran 30% faster for ten minutes of one launch while
the blocks kept their pace), so each case is also compared with the planner's runs on either side
of it: its step over their mean ("paired"), the median over its cases. The planner's first and
last cases show that noise on one split, and a table gives its floor: the planner's own inner cases
paired with its runs two cases either side. Reported
per model and schedule: the best measured split against the planner's (the planner's step / the best
step; and the lowest paired ratio), the old stage-balanced split (split_mode flops) against the
planner's, and the predicted bubble per rank against the measured one before and after calibration
(mean and worst absolute difference in points over the splits measured; "after" also as the calibration would be with no
block boundaries timed and with only the first stage's lead and the last stage's tail, fitted again
from the same recorded actions), and how far the planner's split's measured bubble moved between its
first and last case (this machine's noise, the floor under those errors), and how far each split's
paired ratio is from the calibrated prediction of its step over the planner's. A second table: the bubble's
error with the costs of each part timed in one process (``python -m trainer.measure_costs``, run before each
launch) and the split those costs choose. A third table: a block's
measured time on ranks that waited much against ranks that hardly waited; a fourth: the calibrated
bubble's signed error by how much a rank was predicted to wait (the bias under the noise). With --json, each split's
row also holds each rank's busy time per step, measured and as the calibrated costs predict it, and
its time per block.
"""

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.parallel.pipeline_planner import Simulator  # noqa: E402
from trainer.parallel.schedule_sim import program_for  # noqa: E402

MODELS = {
    "debug": [],
    "12x32k": ["--model.overrides.n_layers", "12", "--model.overrides.vocab_size", "32768"],
}
COMMON = ["--training.steps", "{steps}", "--lr_scheduler.warmup_steps", "1", "--validation.no-enable",
          "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000",
          "--parallelism.pipeline_parallel_degree", "2"]
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}

WORKER = '''
import json, os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.distributed.worker import forget_meshes, in_namespace
from trainer.config import load_config
from trainer.train import main
for i, case in enumerate(json.loads(Path(sys.argv[1]).read_text())):
    in_namespace(f"case{{i}}")
    r = main(load_config(overrides=case["args"]))
    if os.environ.get("RANK", "0") == "0":
        Path(case["out"]).write_text(json.dumps({{"step_times": r.step_times}}))
    forget_meshes()
'''


def load(args: list[str]):
    from tests.conftest import load_plan

    return load_plan(args, 2)


def splits(n: int, stages: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in itertools.combinations(range(1, n), stages - 1)]


def points(counts: tuple[int, ...]) -> str:
    return ",".join(f"layers.{sum(counts[:i])}" for i in range(1, len(counts)))


def predicted_bubbles(sim: Simulator, counts: tuple[int, ...]) -> list[float]:
    p = sim.predict(counts)
    return [p.bubble(r) for r in range(len(p.busy))]


def measured_busy(dump: Path, steps: list[int]) -> list[float]:
    """Each pp rank's busy seconds per step (the sum of its actions), the median over the timed steps."""
    per_step = []
    for s in steps:
        trace = json.loads((dump / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())
        busy = [0.0, 0.0]
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                busy[e["pid"]] += e["dur"] / 1e6
        per_step.append(busy)
    return [statistics.median(b[r] for b in per_step) for r in range(2)]


def measured_bubbles(dumps: list[Path], steps: list[int]) -> list[float]:
    traces = [json.loads((dump / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())["otherData"]
              for dump in dumps for s in steps]
    return [statistics.median(t["bubble"][str(r)] for t in traces) for r in range(2)]


def run_group(model: str, schedule: str, args: argparse.Namespace, tmp: Path) -> dict:
    import torch

    from trainer.train import build_calibration

    base = MODELS[model] + [a.format(steps=args.steps) for a in COMMON] + [
        "--parallelism.pipeline_parallel_schedule", schedule]
    plan = load(base)
    old = load(base + ["--parallelism.pipeline_parallel_split_mode", "flops"])
    p = plan.pipeline
    sim = Simulator(plan.pipeline_costs, program_for(schedule, 2, plan.n_microbatches, p.stages_per_rank))
    every = splits(sum(p.counts), p.num_stages)
    if len(every) > args.max_splits:
        ranked = sorted(every, key=lambda c: sim.predict(c).makespan)
        rest = ranked[10:]
        random.Random(0).shuffle(rest)
        chosen = ranked[:10] + rest[:10]
    else:
        chosen = every
    # The planner's split runs first (its timeline calibrates the predictions) and again after every other
    # case, the others in a fresh seeded order each pass: this machine's speed drifts over a launch (in
    # one launch the 32k-vocabulary output part ran 30% faster for ten minutes while the blocks kept
    # their pace), so each case is also compared with the planner's runs on either side of it.
    others = [c for c in dict.fromkeys([old.pipeline.counts, *chosen]) if c != p.counts]
    order = [p.counts]
    rng = random.Random(1)
    for _ in range(args.repeats):
        for counts in rng.sample(others, len(others)):
            order += [counts, p.counts]
    timed = list(range(args.warmup + 1, args.steps + 1))
    cases = []
    for i, counts in enumerate(order):
        dump = tmp / f"{model}_{schedule}_{i}"
        cases.append({"out": str(dump) + ".json", "counts": counts, "dump": str(dump), "args": base + [
            "--parallelism.pipeline_parallel_split_points", points(counts), "--job.dump_folder", str(dump),
            "--profiling.pipeline_timeline_steps", ",".join(map(str, timed))]})
    # The first case of a launch runs slower (thread pools, allocator, first collectives): a discarded
    # warm-up case of the planner's split goes before the measured ones.
    warm = dict(cases[0], out=cases[0]["out"] + ".warmup", dump=cases[0]["dump"] + "_warmup")
    warm["args"] = [a if a != cases[0]["dump"] else warm["dump"] for a in warm["args"]]
    spec = tmp / f"{model}_{schedule}.json"
    spec.write_text(json.dumps([warm] + cases))
    worker = tmp / "worker.py"
    worker.write_text(WORKER.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # each part timed in one process (python -m trainer.measure_costs), right before the launch: the costs a
    # user gets without running the pipeline
    one_device = tmp / f"{model}_{schedule}_one_device.json"
    if not (args.reuse and one_device.exists()):
        proc = subprocess.run([sys.executable, "-m", "trainer.measure_costs", *base, "--device", "cpu", "--steps", "20",
                               "--out", str(one_device)], cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
    if not (args.reuse and all(Path(c["out"]).exists() for c in cases)):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(worker), str(spec)], cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
    program = program_for(schedule, 2, plan.n_microbatches, p.stages_per_rank)
    # The calibration from the planner's first case's recorded actions, and as it would be with fewer
    # boundaries timed: none (each stage divided as the FLOP model does), and only the first
    # stage's lead and the last stage's tail (the embedding and the output with the per-action cost in
    # them: what the previous version timed).
    last = p.num_stages - 1

    def refit(name: str, keep) -> Simulator:
        folder = tmp / f"{model}_{schedule}_{name}"
        calibration = build_calibration(plan, torch.device("cpu"), folder, program)
        for step in timed:
            trace = json.loads((Path(cases[0]["dump"]) / "profile_traces" / f"pipeline_timeline_step{step}.json")
                               .read_text())
            events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            actions = [(e["args"]["action"], e["args"]["stage"], e["dur"] / 1e6) for e in events]
            parts = [(a["action"], a["stage"], part, a[f"{part}_ms"] / 1e3) for a in (e["args"] for e in events)
                     for part in ("lead", "tail") if f"{part}_ms" in a and keep(a["stage"], part)]
            calibration.add(step, actions, {}, trace["otherData"]["span_us"] / 1e6, parts)
        return Simulator(load(base + ["--parallelism.pipeline_parallel_cost_file",
                                      str(folder / "pipeline_costs.json")]).pipeline_costs, program)

    # the calibration the run wrote (pipeline_costs.json), fitted again by this code from the same steps,
    # so that --reuse reports the current fit
    csim = refit("all_boundaries", lambda stage, part: True)
    wsim = refit("whole_stages", lambda stage, part: False)
    esim = refit("ends_only", lambda stage, part: (stage, part) in ((0, "lead"), (last, "tail")))
    osim = Simulator(load(base + ["--parallelism.pipeline_parallel_cost_file", str(one_device)]).pipeline_costs,
                     program)
    # Each split's step and bubbles over its cases (the planner's: its first case, which the calibration
    # measured, and its last)
    by_split: dict[tuple[int, ...], list[dict]] = {}
    for case in cases:
        by_split.setdefault(tuple(case["counts"]), []).append(case)
    rows = []
    for counts, runs in by_split.items():
        steps = [json.loads(Path(c["out"]).read_text())["step_times"][args.warmup:] for c in runs]
        # each case's median, then the median over the cases: one case in a fast or slow stretch of the
        # machine does not decide the split's figure (pooling the steps let two adjacent cases do so)
        case_bubbles = [measured_bubbles([Path(c["dump"])], timed) for c in runs]
        rows.append({"counts": counts, "step": statistics.median(statistics.median(s) for s in steps),
                     "pooled_step": statistics.median(t for s in steps for t in s), "cases": len(runs),
                     "case_steps": [statistics.median(s) for s in steps],
                     "measured": [statistics.median(b[r] for b in case_bubbles) for r in range(2)],
                     "before": predicted_bubbles(sim, counts), "after": predicted_bubbles(csim, counts),
                     "after_whole_stages": predicted_bubbles(wsim, counts),
                     "after_ends_only": predicted_bubbles(esim, counts),
                     "one_device": predicted_bubbles(osim, counts), "one_device_s": osim.predict(counts).makespan,
                     # each rank's mean seconds per block and microbatch, forward and backward (B or I),
                     # the median over the split's cases
                     "block_s": {k: [statistics.median(b[k][r] for b in [per_block(Path(c["dump"]), timed)
                                                                         for c in runs]) for r in range(2)]
                                 for k in ("forward", "backward")},
                     "predicted_s": csim.predict(counts).makespan,
                     # each rank's busy seconds per step, measured and as the calibrated costs predict them
                     "busy": [statistics.median(b[r] for b in [measured_busy(Path(c["dump"]), timed) for c in runs])
                              for r in range(2)],
                     "busy_predicted": list(csim.predict(counts).busy)})
    case_step = [statistics.median(json.loads(Path(c["out"]).read_text())["step_times"][args.warmup:])
                 for c in cases]
    first, again = case_step[0], case_step[-1]
    # the same split measured at the launch's start and end: how far its bubbles move is this machine's
    # noise, the floor under any prediction's error
    first_bubbles, again_bubbles = (measured_bubbles([Path(c["dump"])], timed) for c in (cases[0], cases[-1]))
    noise = max(abs(a - b) * 100 for a, b in zip(first_bubbles, again_bubbles))
    # each split's step over the planner's on either side of it, the median over its cases (below 1: faster)
    paired: dict[tuple[int, ...], list[float]] = {}
    for i in range(1, len(cases) - 1):
        if tuple(cases[i]["counts"]) != p.counts:
            paired.setdefault(tuple(cases[i]["counts"]), []).append(
                case_step[i] / ((case_step[i - 1] + case_step[i + 1]) / 2))
    for row in rows:
        row["paired"] = statistics.median(paired[row["counts"]]) if row["counts"] in paired else 1.0
    # the noise floor under a paired ratio: each of the planner's inner cases against its own runs two cases
    # either side (the same split, so 1 but for this machine's noise)
    own = [i for i, c in enumerate(cases) if tuple(c["counts"]) == p.counts]
    self_paired = [case_step[own[k]] / ((case_step[own[k - 1]] + case_step[own[k + 1]]) / 2)
                   for k in range(1, len(own) - 1)]
    planner_cases = [case_step[i] for i in own]
    best = min(rows, key=lambda r: r["step"])
    best_paired = min(rows, key=lambda r: r["paired"])
    # how well the calibrated costs predict each split's step relative to the planner's: against the paired
    # ratio, which this machine's drift over the launch moves least
    ratio_err = [abs(r["predicted_s"] / rows[0]["predicted_s"] - r["paired"]) * 100 for r in rows[1:]]
    planner, flops = rows[0], next(r for r in rows if r["counts"] == old.pipeline.counts)
    err = {k: [abs(r[k][i] - r["measured"][i]) * 100 for r in rows for i in range(2)]
           for k in ("before", "after", "after_whole_stages", "after_ends_only", "one_device")}
    calibrated_pick = min(rows, key=lambda r: r["predicted_s"])
    # the split the planner picks with the one-device costs (of those measured here), and its paired ratio
    one_device_pick = min(rows, key=lambda r: r["one_device_s"])
    return {"model": model, "schedule": schedule, "splits": len(every), "measured": len(rows),
            "planner": points(planner["counts"]), "planner_step": planner["step"], "planner_first_step": first,
            "planner_again_step": again,
            "best": points(best["counts"]), "best_step": best["step"],
            "best_paired": points(best_paired["counts"]), "best_paired_ratio": best_paired["paired"],
            "flops": points(flops["counts"]), "flops_step": flops["step"], "flops_paired_ratio": flops["paired"],
            "calibrated_pick": points(calibrated_pick["counts"]), "calibrated_pick_step": calibrated_pick["step"],
            "bubble_err_before": (statistics.mean(err["before"]), max(err["before"])),
            "bubble_err_after": (statistics.mean(err["after"]), max(err["after"])), "bubble_noise": noise,
            "bubble_err_after_whole_stages": (statistics.mean(err["after_whole_stages"]),
                                              max(err["after_whole_stages"])),
            "bubble_err_after_ends_only": (statistics.mean(err["after_ends_only"]), max(err["after_ends_only"])),
            "bubble_err_one_device": (statistics.mean(err["one_device"]), max(err["one_device"])),
            "one_device_pick": points(one_device_pick["counts"]), "one_device_pick_paired": one_device_pick["paired"],
            "slower_when_waiting": slower_when_waiting(rows),
            "bias_by_wait": bias_by_wait(rows),
            "self_paired": (min(self_paired), max(self_paired)) if self_paired else (1.0, 1.0),
            "planner_spread": (min(planner_cases) / statistics.median(planner_cases),
                               max(planner_cases) / statistics.median(planner_cases), len(planner_cases)),
            "paired_vs_predicted": (statistics.mean(ratio_err), max(ratio_err)) if ratio_err else (0.0, 0.0),
            "rows": rows}


def per_block(dump: Path, steps: list[int]) -> dict[str, list[float]]:
    """Each pp rank's mean seconds per block and microbatch over the timed steps, forward and backward (the
    blocks' times the timeline records in each action; a backward is B or I: the first stage's W of a split
    backward, its whole backward, is left out so that both ranks' figures are of one kind)."""
    total = {k: [[0.0, 0] for _ in range(2)] for k in ("forward", "backward")}
    for s in steps:
        trace = json.loads((dump / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())
        for e in trace["traceEvents"]:
            if e["ph"] == "X" and e["args"].get("blocks_ms") and e["cat"] != "W":
                kind = "forward" if e["cat"] == "F" else "backward"
                acc = total[kind][e["pid"]]
                acc[0] += sum(e["args"]["blocks_ms"]) / 1e3
                acc[1] += len(e["args"]["blocks_ms"])
    return {k: [t / n if n else float("nan") for t, n in v] for k, v in total.items()}


WAIT_BANDS = ((0.0, 0.15), (0.15, 0.30), (0.30, 1.0))


def bias_by_wait(rows: list[dict]) -> list[tuple[float, int]]:
    """The calibrated prediction's signed bubble error (measured minus predicted, points) by how much a rank
    was predicted to wait (WAIT_BANDS of the predicted bubble), over every split and rank of a group: (mean,
    how many rank-splits) per band. Noise averages out here; what stays is bias the costs do not model."""
    out = []
    for low, high in WAIT_BANDS:
        errors = [100 * (r["measured"][i] - r["after"][i]) for r in rows for i in range(2)
                  if low <= r["after"][i] < high]
        out.append((statistics.mean(errors) if errors else float("nan"), len(errors)))
    return out


def slower_when_waiting(rows: list[dict]) -> dict[str, tuple[float, float, int, int]]:
    """Forward and backward seconds per block on ranks that waited (measured bubble 40% or more) against
    ranks that hardly did (under 15%), over every split and rank of a group: (median busy, median waiting,
    how many busy, how many waiting)."""
    out = {}
    for kind in ("forward", "backward"):
        busy = [r["block_s"][kind][i] for r in rows for i in range(2) if r["measured"][i] < 0.15]
        waiting = [r["block_s"][kind][i] for r in rows for i in range(2) if r["measured"][i] >= 0.40]
        out[kind] = (statistics.median(busy) if busy else float("nan"),
                     statistics.median(waiting) if waiting else float("nan"), len(busy), len(waiting))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-splits", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over the splits in one launch, each in a seeded shuffled order with the"
                             " planner's split after every case; each split's figures are the medians over its"
                             " passes")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: report from the cases a previous run kept there instead of running them")
    parser.add_argument("--keep", type=Path, help="keep every case's dump folder (timelines, cost files) here")
    args = parser.parse_args()
    if args.reuse and not args.keep:
        parser.error("--reuse reports from the cases kept by an earlier --keep run: name that folder with --keep")
    results = []
    print("| model | schedule | splits (measured) | planner's split: step | same split: first / last case"
          " | best measured split: step | planner/best | best paired: step over the planner's on either side"
          " | old flops split: step | old/planner | paired | calibrated pick: step"
          " | bubble error before calibration, mean/worst (points) | after | after, no boundaries timed"
          " | after, only the first and last stages' own parts | same split twice: bubble moved (points)"
          " | paired ratio against the calibrated prediction's, mean/worst (%) |")
    print("|---|---|---|---|---|---|---:|---|---|---:|---:|---|---|---|---|---|---:|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for model in args.models:
            for schedule in args.schedules:
                r = run_group(model, schedule, args, Path(tmp))
                results.append(r)
                print(f"| {model} | {schedule} | {r['splits']} ({r['measured']})"
                      f" | {r['planner']}: {r['planner_step']:.3f} s"
                      f" | {r['planner_first_step']:.3f} / {r['planner_again_step']:.3f} s"
                      f" | {r['best']}: {r['best_step']:.3f} s"
                      f" | {r['planner_step'] / r['best_step']:.3f}"
                      f" | {r['best_paired']}: {r['best_paired_ratio']:.3f}"
                      f" | {r['flops']}: {r['flops_step']:.3f} s | {r['flops_step'] / r['planner_step']:.3f}"
                      f" | {r['flops_paired_ratio']:.3f}"
                      f" | {r['calibrated_pick']}: {r['calibrated_pick_step']:.3f} s"
                      f" | {r['bubble_err_before'][0]:.1f} / {r['bubble_err_before'][1]:.1f}"
                      f" | {r['bubble_err_after'][0]:.1f} / {r['bubble_err_after'][1]:.1f}"
                      f" | {r['bubble_err_after_whole_stages'][0]:.1f} / {r['bubble_err_after_whole_stages'][1]:.1f}"
                      f" | {r['bubble_err_after_ends_only'][0]:.1f} / {r['bubble_err_after_ends_only'][1]:.1f}"
                      f" | {r['bubble_noise']:.1f}"
                      f" | {r['paired_vs_predicted'][0]:.1f} / {r['paired_vs_predicted'][1]:.1f} |", flush=True)
    print("\nThis machine's noise: the planner's split over its cases (its case medians' lowest and highest over"
          " their median), and each of its inner cases paired with its own runs two cases either side (the same"
          " split: a paired ratio this far from 1 is noise):\n")
    print("| model | schedule | planner's cases | lowest / highest over the median | paired with itself: lowest /"
          " highest |\n|---|---|---:|---|---|")
    for r in results:
        low, high, n = r["planner_spread"]
        print(f"| {r['model']} | {r['schedule']} | {n} | {low:.3f} / {high:.3f}"
              f" | {r['self_paired'][0]:.3f} / {r['self_paired'][1]:.3f} |")
    print("\nEach part timed in one process before the launch (python -m trainer.measure_costs, OMP_NUM_THREADS=1),"
          " no pipeline run: the predicted bubble's error with those costs (points, mean / worst) beside the FLOP"
          " model's and the timed pipeline run's, and the split those costs choose among the measured ones:\n")
    print("| model | schedule | FLOP model | timed pipeline run | one device | one device's pick: paired ratio |")
    print("|---|---|---|---|---|---|")
    for r in results:
        errors = " | ".join(f"{r[k][0]:.1f} / {r[k][1]:.1f}" for k in ("bubble_err_before", "bubble_err_after",
                                                                         "bubble_err_one_device"))
        print(f"| {r['model']} | {r['schedule']} | {errors}"
              f" | {r['one_device_pick']}: {r['one_device_pick_paired']:.3f} |")
    print("\nA block's time on the ranks that waited (measured bubble 40% or more) against those that hardly did"
          " (under 15%), over every split and rank (ms per block and microbatch, medians; how many rank-splits):\n")
    print("| model | schedule | forward: busy / waiting (ratio) | backward: busy / waiting (ratio) |")
    print("|---|---|---|---|")
    for r in results:
        cells = [f"{1e3 * b:.2f} ({nb}) / {1e3 * w:.2f} ({nw}) ({w / b:.3f})"
                 for b, w, nb, nw in (r["slower_when_waiting"][k] for k in ("forward", "backward"))]
        print(f"| {r['model']} | {r['schedule']} | {cells[0]} | {cells[1]} |")
    print("\nThe calibrated bubble's signed error (measured minus predicted, points: mean over the rank-splits, how"
          " many) by how much the calibrated costs predict a rank to wait:\n")
    print("| model | schedule | " + " | ".join(f"predicted {100 * lo:.0f}-{100 * hi:.0f}%" for lo, hi in WAIT_BANDS)
          + " |\n|---|---|" + "---:|" * len(WAIT_BANDS))
    for r in results:
        print(f"| {r['model']} | {r['schedule']} | "
              + " | ".join(f"{mean:+.1f} ({n})" if n else "none" for mean, n in r["bias_by_wait"]) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=list))


if __name__ == "__main__":
    main()
