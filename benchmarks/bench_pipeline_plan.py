"""The pipeline planner against measurement: the step of every contiguous split, PP2 on CPU.

    python benchmarks/bench_pipeline_plan.py                     # both models, four schedules
    python benchmarks/bench_pipeline_plan.py --models debug --schedules ZBVZeroBubble
    python benchmarks/bench_pipeline_plan.py --pool a.json b.json     # tables over earlier --json reports

For each model (the 6-block debug model; a 12-block Llama with a 32k vocabulary, whose output
projection costs about ten blocks; not run by default, an 8-block one with an 8k vocabulary and a
10-block one with a 16k vocabulary, shapes kept out of the planner's tuning) and schedule (1F1B,
Interleaved1F1B, ZBVZeroBubble, DualPipeV at pp 2), one torchrun launch builds a trainer for every
contiguous split the schedule allows (where there are more than --max-splits, the best 10 by the
planner's prediction plus 10 random ones) and the old stage-balanced split, and alternates their
steps: after --warmup discarded steps of each, --repeats rounds in which every split takes one step, in a seeded
shuffled order, with a step of the planner's split after each, the pipeline timeline recording
every measured step. This machine's speed drifts over seconds and minutes; steps about a second
apart see the same machine, and every split's steps are spread over the whole launch, so a split's
median step is comparable with the planner's, and its step over the planner's steps on either side
of it ("paired", the median over its rounds) cancels the drift. The planner's steps over the launch
calibrate the predictions (its recorded actions fitted as ``pipeline_costs.json`` is), and a table
gives the noise floor: each of the planner's steps paired with its own steps either side.

Reported per model and schedule: the best measured split against the planner's (the planner's
median step / the best median step; and the lowest paired ratio), the old stage-balanced split
(split_mode flops) against the planner's, and the predicted bubble per rank against the measured
one (the median over a split's steps) before and after calibration (mean and worst absolute
difference in points over the splits measured; "after" also as the calibration would be with no
block boundaries timed and with only the first stage's lead and the last stage's tail), how far
the planner's split's measured bubble moved between the first and the last round (this machine's
noise, the floor under those errors), how far each split's measured bubble, the median over its
odd-numbered rounds, is from the median over its even-numbered ones (how well the measurement
reproduces itself), and how far each split's paired ratio is from the calibrated
prediction of its step over the planner's. A second table: the bubble's error with the costs of
each part timed in one process (``python -m trainer.measure_costs``, run before each launch) and the
split those costs choose. A third table: a block's measured time on ranks that waited much against
ranks that hardly waited; a fourth: on ranks that hardly waited, as the other rank waited little or
much (whether a rank's pace depends on the other's load; bench_core_sharing.py times the parts
alone and beside a second process, without a pipeline); a fifth: the calibrated bubble's signed
error by how much a rank was predicted to wait (the bias under the noise). With --json, each split's
row also holds its measured steps, each rank's busy time per step, measured and as the calibrated
costs predict it, and its time per block.

Earlier versions ran each split as its own training (a case of several steps, rebuilt each time),
with the planner's split between cases; the planner's split paired with itself 0.69-0.86 at its
lowest on a noisy day.
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

from arguments import at_least  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.pipeline.search import Simulator  # noqa: E402
from trainer.pipeline.simulate import program_for  # noqa: E402

MODELS = {
    "debug": [],
    "12x32k": ["--model.overrides.n_layers", "12", "--model.overrides.vocab_size", "32768"],
    # a held-out shape between the two: its output part costs about 2.4 blocks by FLOPs (debug 0.6, 12x32k 9.7)
    "8x8k": ["--model.overrides.n_layers", "8", "--model.overrides.vocab_size", "8192"],
    # a second held-out shape (2026-11-27): its output part costs about 4.8 blocks by FLOPs
    "10x16k": ["--model.overrides.n_layers", "10", "--model.overrides.vocab_size", "16384"],
    # parts that sleep known times (benchmarks/sleep_model.py): the FLOP model prices them exactly, so what is
    # left is the simulation against torch's schedules; not run by default
    "sleep": ["--model.modules", "sleep_model", "--model.name", "sleep", "--model.flavor", "equal",
              "--model.attn_mask_type", "causal"],
    "sleep_unequal": ["--model.modules", "sleep_model", "--model.name", "sleep", "--model.flavor", "unequal",
                      "--model.attn_mask_type", "causal"],
}
COMMON = ["--training.steps", "{steps}", "--lr_scheduler.warmup_steps", "1", "--validation.no-enable",
          "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000",
          "--parallelism.pipeline_parallel_degree", "2"]
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}

WORKER = '''
import gc, json, logging, os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from trainer.config import load_config
from trainer.env import init_device
from trainer.log import init_logging
from trainer.parallel.mesh import init_distributed
from trainer.plan import build_job_plan
from trainer.train import build_trainer, prepare_folders, run_step
spec = json.loads(Path(sys.argv[1]).read_text())
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
init_logging(logging.WARNING)
device = init_device(int(os.environ["LOCAL_RANK"]))
runs = []
for args in spec["runs"]:  # one trainer per split, all built before any step
    plan = build_job_plan(load_config(overrides=args), world)
    if not dist.is_initialized():
        init_distributed(device, plan.config.comm.init_timeout_seconds)
    prepare_folders(plan.config)
    run = build_trainer(plan, device, rank == plan.reporting_rank)
    if run.timeline is not None:
        run.timeline.calibration = None  # the benchmark fits the planner's costs from its traces itself
    runs.append(run)
done, seconds = [0] * len(runs), []
gc.disable()  # as train_loop: collected at known points, between steps
for k, i in enumerate(spec["order"]):
    if k % 20 == 0:
        gc.collect(1)
    done[i] += 1
    seconds.append(run_step(runs[i], done[i], first=done[i] == 1).seconds)
gc.enable()
for run in runs:
    run.metrics.close()
    run.loader.close()
if rank == 0:
    Path(spec["out"]).write_text(json.dumps(seconds))
dist.destroy_process_group()
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


def halves_apart(dump: Path, steps: list[int]) -> list[float] | None:
    """Each pp rank's measured bubble, the median over the odd-numbered timed steps against that over the
    even-numbered ones: how far apart (a fraction). How well the measurement reproduces itself: a prediction
    can be judged no closer than this (None with fewer than two steps)."""
    if len(steps) < 2:
        return None
    odd, even = (measured_bubbles([dump], steps[k::2]) for k in (0, 1))
    return [abs(a - b) for a, b in zip(odd, even, strict=True)]


class KeptLaunchDiffers(Exception):
    """--reuse with other settings than the kept launch ran: its steps cannot be matched to splits."""


def run_group(model: str, schedule: str, args: argparse.Namespace, tmp: Path) -> dict:
    import torch

    from trainer.train import build_calibration

    def job(steps: int) -> list[str]:  # the group's overrides; --training.steps sets the learning-rate schedule
        return MODELS[model] + [a.format(steps=steps) for a in COMMON] + [
            "--parallelism.pipeline_parallel_schedule", schedule]

    base = job(100)  # the plan does not depend on the steps
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
    # Every split gets its own trainer, all built in one launch, and their steps alternate: the planner's
    # split after every other split's step, the others in a fresh seeded order each round. This machine's
    # speed drifts over seconds and minutes (in one launch the 32k-vocabulary output part ran 30% faster for
    # ten minutes while the blocks kept their pace); steps a second apart see the same machine, and every
    # split's steps are spread over the whole launch, so their medians are comparable.
    runs = [p.counts] + [c for c in dict.fromkeys([old.pipeline.counts, *chosen]) if c != p.counts]
    order = [i for i in range(len(runs)) for _ in range(args.warmup)]  # each trainer's first steps: discarded
    order.append(0)
    rng = random.Random(1)
    for _ in range(args.repeats):
        for i in rng.sample(range(1, len(runs)), len(runs) - 1):
            order += [i, 0]
    totals = [order.count(i) for i in range(len(runs))]
    timed = {i: list(range(args.warmup + 1, totals[i] + 1)) for i in range(len(runs))}  # each run's measured steps
    dumps = [tmp / f"{model}_{schedule}_{i}" for i in range(len(runs))]
    spec = tmp / f"{model}_{schedule}.json"
    out = tmp / f"{model}_{schedule}_steps.json"
    launch = not (args.reuse and out.exists())
    # a kept launch's steps are matched to splits by its order and its list of splits (the planner's first): reusing
    # them takes the settings it ran with, and a planner that still chooses the split it chose
    if not launch:
        kept = json.loads(spec.read_text()) if spec.exists() else None
        if kept is None or kept["order"] != order:
            raise KeptLaunchDiffers(f"--reuse: the launch kept in {tmp} for {model} {schedule} ran another order of"
                                    " steps; pass the --warmup, --repeats and --max-splits it ran with")
        ran = [run[run.index("--parallelism.pipeline_parallel_split_points") + 1] for run in kept["runs"]]
        if ran != [points(c) for c in runs]:
            raise KeptLaunchDiffers(f"--reuse: the launch kept in {tmp} for {model} {schedule} ran the splits {ran}"
                                    f" (the planner's first), this planner's list is {[points(c) for c in runs]}:"
                                    " its steps would be read as other splits'")
    base = job(max(totals))  # the most steps any trainer takes
    worker = tmp / "worker.py"
    if launch:  # a report from kept steps leaves their launch's files as they are
        spec.write_text(json.dumps({"out": str(out), "order": order, "runs": [base + [
            "--parallelism.pipeline_parallel_split_points", points(counts), "--job.dump_folder", str(dumps[i]),
            "--profiling.pipeline_timeline_steps", ",".join(map(str, timed[i]))] for i, counts in enumerate(runs)]}))
        worker.write_text(WORKER.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # the sleep models' family is importable by name in every process
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))}
    # each part timed in one process (python -m trainer.measure_costs), right before the launch: the costs a
    # user gets without running the pipeline
    one_device = tmp / f"{model}_{schedule}_one_device.json"
    if not (args.reuse and one_device.exists()):
        proc = subprocess.run([sys.executable, "-m", "trainer.measure_costs", *base, "--device", "cpu", "--steps", "20",
                               "--out", str(one_device)], cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
    if launch:
        # torchrun's log folder with the launch's files (without --log-dir it leaves one in /tmp at each launch)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "--log-dir", str(tmp / "torchrun"), str(worker), str(spec)], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
    seconds = json.loads(out.read_text())
    # the measured steps in launch order: (run, seconds)
    seen = [0] * len(runs)
    sequence = []
    for i, t in zip(order, seconds, strict=True):
        seen[i] += 1
        if seen[i] > args.warmup:
            sequence.append((i, t))
    steps_of = {i: [t for j, t in sequence if j == i] for i in range(len(runs))}
    program = program_for(schedule, 2, plan.n_microbatches, p.stages_per_rank)
    # The calibration from the planner's recorded actions over the launch, and as it would be with fewer
    # boundaries timed: none (each stage divided as the FLOP model does), and only the first
    # stage's lead and the last stage's tail (the embedding and the output with the per-action cost in
    # them: what the previous version timed).
    last = p.num_stages - 1

    def refit(name: str, keep) -> Simulator:
        """The planner's split's recorded actions fitted as its timed run's calibration does (lead and tail parts
        where ``keep(stage, part)``), written to the folder ``name``; a Simulator with those costs."""
        folder = tmp / f"{model}_{schedule}_{name}"
        calibration = build_calibration(plan, torch.device("cpu"), folder, program)
        actions, parts, spans = [], [], []
        for step in timed[0]:
            trace = json.loads((dumps[0] / "profile_traces" / f"pipeline_timeline_step{step}.json").read_text())
            events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            actions += [(e["args"]["action"], e["args"]["stage"], e["dur"] / 1e6) for e in events]
            parts += [(a["action"], a["stage"], part, a[f"{part}_ms"] / 1e3) for a in (e["args"] for e in events)
                      for part in ("lead", "tail") if f"{part}_ms" in a and keep(a["stage"], part)]
            parts += [(a["action"], a["stage"], "blocks", sum(a["blocks_ms"]) / 1e3)
                      for a in (e["args"] for e in events) if a.get("blocks_ms")]
            spans.append(trace["otherData"]["span_us"] / 1e6)
        # one call with every step's actions: the fit takes per-action means, the transfer the median span
        bubbles = dict(enumerate(measured_bubbles([dumps[0]], timed[0])))
        calibration.add(timed[0][-1], actions, bubbles, statistics.median(spans), parts)
        return Simulator(load(base + ["--parallelism.pipeline_parallel_cost_file",
                                      str(folder / "pipeline_costs.json")]).pipeline_costs, program)

    csim = refit("all_boundaries", lambda stage, part: True)
    wsim = refit("whole_stages", lambda stage, part: False)
    esim = refit("ends_only", lambda stage, part: (stage, part) in ((0, "lead"), (last, "tail")))
    osim = Simulator(load(base + ["--parallelism.pipeline_parallel_cost_file", str(one_device)]).pipeline_costs,
                     program)
    # The FLOP model with the loss's and the embedding gradient's bytes priced (pipeline_parallel_device_memory_
    # gbytes_per_second), at this machine's rates: the FLOPs of a block's forward over its one-device time, and the
    # bandwidth of a large copy (--memory-gbps)
    # (beside the same model in seconds without the bytes: transfers are priced by the link settings in both)
    bandwidth = getattr(args, "memory_bytes_per_second", 0.0)
    at_one = load(base + ["--parallelism.pipeline_parallel_device_tflops", "1"]).pipeline_costs  # seconds = TFLOPs
    timed_f = json.loads(one_device.read_text())["measured"]["parts_s"]["F"][1:-1]
    tflops = statistics.fmean(at_one.parts["F"][1:-1]) / statistics.fmean(timed_f)
    # (float32, as the trainers compute on CPU: the plan is otherwise made for accelerators, in bf16)
    at_rate = base + ["--parallelism.pipeline_parallel_device_tflops", repr(tflops),
                      "--training.mixed_precision_param", "float32"]
    ssim = Simulator(load(at_rate).pipeline_costs, program)
    msim = Simulator(load(at_rate + ["--parallelism.pipeline_parallel_device_memory_gbytes_per_second",
                                     repr(bandwidth / 1e9)]).pipeline_costs, program) if bandwidth else None
    rows = []
    for i, counts in enumerate(runs):
        rows.append({"counts": counts, "step": statistics.median(steps_of[i]), "steps": len(steps_of[i]),
                     "step_times": steps_of[i],
                     "measured": measured_bubbles([dumps[i]], timed[i]),
                     "halves_apart": halves_apart(dumps[i], timed[i]),
                     "before": predicted_bubbles(sim, counts), "after": predicted_bubbles(csim, counts),
                     "before_seconds": predicted_bubbles(ssim, counts),
                     "before_memory": predicted_bubbles(msim, counts) if msim else None,
                     "after_whole_stages": predicted_bubbles(wsim, counts),
                     "after_ends_only": predicted_bubbles(esim, counts),
                     "one_device": predicted_bubbles(osim, counts), "one_device_s": osim.predict(counts).makespan,
                     # each rank's mean seconds per block and microbatch, forward and backward (B or I)
                     "block_s": per_block(dumps[i], timed[i]),
                     "predicted_s": csim.predict(counts).makespan,
                     # each rank's busy seconds per step, measured and as the calibrated costs predict them
                     "busy": measured_busy(dumps[i], timed[i]), "busy_predicted": list(csim.predict(counts).busy)})
    # the planner's split in the first and the last round: how far its step and bubbles move is this machine's
    # noise, the floor under any prediction's error
    per_round = len(runs) - 1  # the planner's steps in a round (the first round has one more, before its first split)
    own = steps_of[0]
    first, again = statistics.median(own[:per_round + 1]), statistics.median(own[-per_round:])
    first_bubbles, again_bubbles = (measured_bubbles([dumps[0]], steps) for steps in (timed[0][:per_round + 1],
                                                                                       timed[0][-per_round:]))
    noise = max(abs(a - b) * 100 for a, b in zip(first_bubbles, again_bubbles))
    # each split's step over the planner's steps either side of it (a second or so apart), the median over
    # its rounds (below 1: faster)
    paired: dict[int, list[float]] = {}
    for k in range(1, len(sequence) - 1):
        if sequence[k][0] != 0:
            beside = (sequence[k - 1][1] + sequence[k + 1][1]) / 2
            paired.setdefault(sequence[k][0], []).append(sequence[k][1] / beside)
    for i, row in enumerate(rows):
        row["paired"] = statistics.median(paired[i]) if i in paired else 1.0
    # the noise floor under a paired ratio: each of the planner's inner steps against its own steps either side
    # (one other split's step between: the same split, so 1 but for this machine's noise)
    self_paired = [own[k] / ((own[k - 1] + own[k + 1]) / 2) for k in range(1, len(own) - 1)]
    # and as a split's paired figure is made: one such step from each round (every per_round-th), their median;
    # the lowest and highest of those medians are how far from 1 a split's paired figure strays by noise alone
    self_medians = [statistics.median(self_paired[j::per_round]) for j in range(min(per_round, len(self_paired)))]
    best = min(rows, key=lambda r: r["step"])
    best_paired = min(rows, key=lambda r: r["paired"])
    # how well the calibrated costs predict each split's step relative to the planner's: against the paired
    # ratio, which this machine's drift over the launch moves least
    ratio_err = [abs(r["predicted_s"] / rows[0]["predicted_s"] - r["paired"]) * 100 for r in rows[1:]]
    planner, flops = rows[0], next(r for r in rows if r["counts"] == old.pipeline.counts)
    err = {k: [abs(r[k][i] - r["measured"][i]) * 100 for r in rows if r[k] is not None for i in range(2)]
           for k in ("before", "after", "after_whole_stages", "after_ends_only", "one_device", "before_seconds",
                     "before_memory")}
    # the measurement against itself: each split's odd rounds' median bubble against its even rounds'
    apart = [100 * d for r in rows if r["halves_apart"] for d in r["halves_apart"]]
    # predictions equal but for their last bits (splits with the same blocks on each rank; two reports from the
    # same kept steps differed there) are ties, and the planner's split, first, wins them, as the planner's own
    # search rounds them
    def pick(key: str) -> dict:
        return min(rows, key=lambda r: float(f"{r[key]:.9g}"))

    calibrated_pick = pick("predicted_s")
    # the split the planner picks with the one-device costs (of those measured here), and its paired ratio
    one_device_pick = pick("one_device_s")
    return {"model": model, "schedule": schedule, "splits": len(every), "measured": len(rows),
            "job": base, "planner_timed_steps": timed[0],  # the overrides all trainers share; the planner's steps
            "planner": points(planner["counts"]), "planner_step": planner["step"], "planner_first_step": first,
            "planner_again_step": again,
            "best": points(best["counts"]), "best_step": best["step"],
            "best_paired": points(best_paired["counts"]), "best_paired_ratio": best_paired["paired"],
            "flops": points(flops["counts"]), "flops_step": flops["step"], "flops_paired_ratio": flops["paired"],
            "calibrated_pick": points(calibrated_pick["counts"]), "calibrated_pick_step": calibrated_pick["step"],
            "bubble_err_before": (statistics.mean(err["before"]), max(err["before"])),
            "bubble_err_after": (statistics.mean(err["after"]), max(err["after"])), "bubble_noise": noise,
            "bubble_halves_apart": (statistics.mean(apart), max(apart)) if apart else (float("nan"),) * 2,
            "bubble_err_after_whole_stages": (statistics.mean(err["after_whole_stages"]),
                                              max(err["after_whole_stages"])),
            "bubble_err_after_ends_only": (statistics.mean(err["after_ends_only"]), max(err["after_ends_only"])),
            "bubble_err_one_device": (statistics.mean(err["one_device"]), max(err["one_device"])),
            "memory_rates": (tflops, bandwidth / 1e9),
            **{f"bubble_err_{k}": ((statistics.mean(err[k]), max(err[k])) if err[k] else (float("nan"),) * 2)
               for k in ("before_seconds", "before_memory")},
            "one_device_pick": points(one_device_pick["counts"]), "one_device_pick_paired": one_device_pick["paired"],
            "slower_when_waiting": slower_when_waiting(rows),
            "faster_beside_waiting": faster_beside_a_waiting_rank(rows),
            "bias_by_wait": bias_by_wait(rows),
            "self_paired": (min(self_paired), max(self_paired)) if self_paired else (1.0, 1.0),
            "self_paired_medians": (min(self_medians), max(self_medians)) if self_medians else (1.0, 1.0),
            "planner_spread": (min(own) / statistics.median(own), max(own) / statistics.median(own), len(own)),
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


def errors_by_wait(rows: list[dict], key: str = "after") -> list[list[float]]:
    """A prediction's signed bubble errors (measured minus predicted, points) of every split and rank of a group, in
    the WAIT_BANDS of the predicted bubble. ``key``: "before" (the FLOP model), "one_device" or "after" (the timed
    run)."""
    return [[100 * (r["measured"][i] - r[key][i]) for r in rows if r[key] is not None for i in range(2)
             if low <= r[key][i] < high] for low, high in WAIT_BANDS]


def bias_by_wait(rows: list[dict], key: str = "after") -> list[tuple[float, int]]:
    """The calibrated prediction's signed bubble error by how much a rank was predicted to wait, over every
    split and rank of a group (``errors_by_wait``): (mean, how many rank-splits) per band. Noise averages out
    here; what stays is bias the costs do not model."""
    return [(statistics.mean(errors) if errors else float("nan"), len(errors)) for errors in errors_by_wait(rows, key)]


POOLED = {"before": "before calibration (the FLOP model)", "one_device": "parts timed on one device",
          "after": "calibrated from the timed run"}


def pool(reports: list[Path]) -> None:
    """A table over the groups of earlier --json reports, per model: the signed error by predicted wait, pooled
    over every rank-split (and in how many groups the band's mean was negative)."""
    groups = [g for path in reports for g in json.loads(path.read_text())]
    print(f"Pooled over {len(groups)} groups of {len(reports)} reports. Signed bubble error (measured minus predicted,"
          " points) by how much a rank is predicted to wait, each prediction banded by itself: mean (rank-splits),"
          " groups whose band's mean is negative:\n")
    print("| model | prediction | " + " | ".join(f"predicted {100 * lo:.0f}-{100 * hi:.0f}%" for lo, hi in WAIT_BANDS)
          + " |\n|---|---|" + "---|" * len(WAIT_BANDS))
    for model in dict.fromkeys(g["model"] for g in groups):
        for key, name in POOLED.items():
            per_group = [errors_by_wait(g["rows"], key) for g in groups if g["model"] == model]
            cells = []
            for band in range(len(WAIT_BANDS)):
                errors = [e for bands in per_group for e in bands[band]]
                means = [statistics.mean(bands[band]) for bands in per_group if bands[band]]
                cells.append(f"{statistics.mean(errors):+.2f} ({len(errors)}), {sum(m < 0 for m in means)} of"
                             f" {len(means)}" if errors else "none")
            print(f"| {model} | {name} | " + " | ".join(cells) + " |")


def block_paces(rows: list[dict], first, second) -> dict[str, tuple[float, float, int, int]]:
    """Forward and backward seconds per block on the ranks ``first`` keeps against those ``second`` keeps, over
    every split and rank of a group; each predicate takes (the rank's measured bubble, the other rank's).
    (median of the first, median of the second, how many of each) per kind."""
    out = {}
    for kind in ("forward", "backward"):
        kept = [[r["block_s"][kind][i] for r in rows for i in range(2) if keep(r["measured"][i], r["measured"][1 - i])]
                for keep in (first, second)]
        out[kind] = (*(statistics.median(k) if k else float("nan") for k in kept), *(len(k) for k in kept))
    return out


def slower_when_waiting(rows: list[dict]) -> dict[str, tuple[float, float, int, int]]:
    """Ranks that hardly waited (measured bubble under 15%) against ranks that waited (40% or more)."""
    return block_paces(rows, lambda own, other: own < 0.15, lambda own, other: own >= 0.40)


def faster_beside_a_waiting_rank(rows: list[dict]) -> dict[str, tuple[float, float, int, int]]:
    """Ranks that hardly waited (under 15%), as the other rank waited little (under 25%) or much (40% or more).
    Below 1 as a ratio: a rank computed faster while the other one idled."""
    return block_paces(rows, lambda own, other: own < 0.15 and other < 0.25,
                       lambda own, other: own < 0.15 and other >= 0.40)


def pace_cells(paces: dict[str, tuple[float, float, int, int]]) -> list[str]:
    """A report's forward and backward cells: first (how many) / second (how many) (ratio)."""
    return [f"{1e3 * a:.2f} ({na}) / {1e3 * b:.2f} ({nb}) ({b / a:.3f})" if na and nb else "none to compare"
            for a, b, na, nb in (paces[k] for k in ("forward", "backward"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["debug", "12x32k"], choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--warmup", type=at_least(0), default=2, help="each trainer's first steps, not measured")
    parser.add_argument("--max-splits", type=at_least(1), default=20)
    parser.add_argument("--repeats", type=at_least(1), default=7,
                        help="rounds: in each, every split's trainer takes one step, in a seeded shuffled order,"
                             " the planner's split a step after each; a split's figures are medians over its rounds")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--memory-gbps", default="copy",
                        help="GB/s for the memory model's column, or 'copy': one large copy's, measured (one thread)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: report from the steps a previous run kept there instead of running them")
    parser.add_argument("--keep", type=Path, help="keep every case's dump folder (timelines, cost files) here")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: tables pooled over the groups of earlier --json reports of this version"
                             " (--keep, --reuse and --json are refused with it; the models and schedules are the"
                             " reports')")
    args = parser.parse_args()
    if args.pool:
        if given := [name for name, v in (("--keep", args.keep), ("--reuse", args.reuse), ("--json", args.json)) if v]:
            parser.error(f"--pool runs nothing, so {' and '.join(given)} would do nothing: leave them out")
        try:
            pool(args.pool)
        except OSError as e:
            parser.error(f"--pool: {e.filename}: {e.strerror}")
        except (ValueError, KeyError, TypeError) as e:
            parser.error(f"--pool: a report this version of the benchmark did not write ({type(e).__name__}: {e});"
                         " write it again from its launch with --keep DIR --reuse --json FILE")
        return
    if args.reuse and not args.keep:
        parser.error("--reuse reports from the steps kept by an earlier --keep run: name that folder with --keep")
    kept_rate = args.keep / "memory_bytes_per_second.json" if args.keep else None
    if args.memory_gbps != "copy":
        args.memory_bytes_per_second = float(args.memory_gbps) * 1e9
    elif args.reuse and kept_rate and kept_rate.exists():  # the rate measured with the launch
        args.memory_bytes_per_second = json.loads(kept_rate.read_text())
    else:  # one thread, as each trainer runs
        import torch
        from bench_pipeline_costs import copy_bytes_per_second  # beside this script

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        args.memory_bytes_per_second = copy_bytes_per_second("cpu")
        torch.set_num_threads(threads)
        if kept_rate:
            args.keep.mkdir(parents=True, exist_ok=True)
            kept_rate.write_text(json.dumps(args.memory_bytes_per_second))
    results = []
    print("| model | schedule | splits (measured) | planner's split: step | same split: first / last round"
          " | best measured split: step | planner/best | best paired: step over the planner's on either side"
          " | old flops split: step | old/planner | paired | calibrated pick: step"
          " | bubble error before calibration, mean/worst (points) | after | after, no boundaries timed"
          " | after, only the first and last stages' own parts | first / last round: bubble moved (points)"
          " | a split's odd against its even rounds: median bubbles apart, mean/worst (points)"
          " | paired ratio against the calibrated prediction's, mean/worst (%) |")
    print("|---|---|---|---|---|---|---:|---|---|---:|---:|---|---|---|---|---|---:|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for model in args.models:
            for schedule in args.schedules:
                try:
                    r = run_group(model, schedule, args, Path(tmp))
                except KeptLaunchDiffers as e:
                    parser.error(str(e))
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
                      f" | {r['bubble_halves_apart'][0]:.1f} / {r['bubble_halves_apart'][1]:.1f}"
                      f" | {r['paired_vs_predicted'][0]:.1f} / {r['paired_vs_predicted'][1]:.1f} |", flush=True)
    print("\nThis machine's noise: the planner's split over its steps (the lowest and highest over their median),"
          " and each of its inner steps paired with its own steps either side (the same split, one other split's"
          " step between: a paired ratio this far from 1 is noise), and those paired steps taken one per round as a"
          " split's are, the median of each such set (how far a split's paired figure strays by noise alone):\n")
    print("| model | schedule | planner's steps | lowest / highest over the median | paired with itself: lowest /"
          " highest | as a split's paired figure: lowest / highest |\n|---|---|---:|---|---|---|")
    for r in results:
        low, high, n = r["planner_spread"]
        print(f"| {r['model']} | {r['schedule']} | {n} | {low:.3f} / {high:.3f}"
              f" | {r['self_paired'][0]:.3f} / {r['self_paired'][1]:.3f}"
              f" | {r['self_paired_medians'][0]:.3f} / {r['self_paired_medians'][1]:.3f} |")
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
    if args.memory_bytes_per_second:
        print("\nThe FLOP model with the loss's and the embedding gradient's bytes priced"
              " (--parallelism.pipeline_parallel_device_memory_gbytes_per_second) at this machine's rates: a block's"
              " forward FLOPs over its one-device time, and the bandwidth of a large copy (--memory-gbps"
              f"{', measured once, kept with the launch' if args.memory_gbps == 'copy' else ''}); the predicted"
              " bubble's error (points, mean / worst) beside the FLOP model's in relative units and in seconds at"
              " the same throughput without the bytes (its transfers priced by the link settings, as with them):\n")
        print("| model | schedule | TFLOP/s | GB/s | FLOP model | in seconds | with the bytes |")
        print("|---|---|---:|---:|---|---|---|")
        for r in results:
            print(f"| {r['model']} | {r['schedule']} | {r['memory_rates'][0]:.3f} | {r['memory_rates'][1]:.1f}"
                  + "".join(f" | {r[k][0]:.1f} / {r[k][1]:.1f}"
                            for k in ("bubble_err_before", "bubble_err_before_seconds", "bubble_err_before_memory"))
                  + " |")
    print("\nA block's time on the ranks that waited (measured bubble 40% or more) against those that hardly did"
          " (under 15%), over every split and rank (ms per block and microbatch, medians; how many rank-splits):\n")
    print("| model | schedule | forward: busy / waiting (ratio) | backward: busy / waiting (ratio) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['schedule']} | " + " | ".join(pace_cells(r["slower_when_waiting"])) + " |")
    print("\nA block's time on the ranks that hardly waited (under 15%), as the other rank waited little (under 25%)"
          " or much (40% or more), over every split (ms per block and microbatch, medians; how many splits):\n")
    print("| model | schedule | forward: beside a busy / a waiting rank (ratio) | backward: beside a busy / a waiting"
          " rank (ratio) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['schedule']} | " + " | ".join(pace_cells(r["faster_beside_waiting"])) + " |")
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
