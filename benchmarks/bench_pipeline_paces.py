"""Pace models for the calibrated bubble, judged on the steps a bench_pipeline_plan launch kept.

    python benchmarks/bench_pipeline_plan.py --models debug --repeats 30 --keep /tmp/plan30
    python benchmarks/bench_pipeline_paces.py --keep /tmp/plan30 --repeats 30

The calibration prices a block alike on every rank, fitted on the planner's split, where both
ranks are busy. On lopsided splits of a 2-core CPU the rank that waits runs its blocks slower than
the busy one. This script replays every split a launch measured with the calibrated costs and one
pace model at a time, fitted where it can be on what a calibration run has (the planner's split's
steps), and reports the predicted bubble's error against the measured one (points, mean / worst
over splits and ranks), as bench_pipeline_plan's "after" column does:

- as calibrated: the costs alone (bench_pipeline_plan's "after");
- after idling: an action that starts after its rank idled over a millisecond costs 1 + w times,
  w from the planner's split (such actions' mean time over the others', per action and stage);
- own wait, one run: a rank's actions cost 1 + k x its bubble (a fixed point of the replay), k
  from the planner's split (its ranks' block paces against their bubbles);
- own wait, two runs: k from the planner's split and the split whose ranks' measured bubbles are
  furthest apart (that split then left out of the figures): what a second calibration run would give;
- both busy: a rank computes 1 + c times slower while the other computes too (a fluid replay), c
  fitted on the planner's split's actions (their time against how much of it the other rank
  computed), and c set by hand (--contention; not a calibration: chosen, not fitted).

Every model's transfer time is fitted again so that the planner's split's simulated step equals its
measured median span, as the calibration's is. Steps are read with bench_pipeline_plan's own code
(--reuse): pass the --warmup, --repeats and --max-splits the launch ran with.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import bench_pipeline_plan as plan_bench  # noqa: E402  (beside this script)

from trainer.parallel.pipeline_calibration import transfer_for_span  # noqa: E402
from trainer.parallel.pipeline_cost import fit_pace, pace_spread  # noqa: E402
from trainer.parallel.schedule_sim import KIND_INDEX, Deadlock, Program, program_for, replay_paced  # noqa: E402

IDLE = 1e-3  # seconds a rank must idle before an action for it to count as started after idling


def actions_of(dump: Path, steps: list[int]) -> list[list[dict]]:
    """Each timed step's recorded actions (trace events)."""
    return [[e for e in json.loads((dump / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())
             ["traceEvents"] if e["ph"] == "X"] for s in steps]


def fit_idle(steps: list[list[dict]]) -> tuple[float, float]:
    """(w, the share of actions started after idling): per (kind, stage), the mean time of the actions that
    started over IDLE after their rank's previous one ended against the others', weighted by the smaller count."""
    groups: dict[tuple, tuple[list, list]] = {}
    for events in steps:
        for rank in {e["pid"] for e in events}:
            end = None
            for e in sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"]):
                after = end is not None and (e["ts"] - end) / 1e6 > IDLE
                end = e["ts"] + e["dur"]
                groups.setdefault((e["cat"], e["args"]["stage"]), ([], []))[after].append(e["dur"])
    weighted = [(statistics.mean(woke) / statistics.mean(kept) - 1, min(len(woke), len(kept)))
                for kept, woke in groups.values() if kept and woke]
    total = sum(n for _, n in weighted)
    share = sum(len(w) for _, w in groups.values()) / sum(len(k) + len(w) for k, w in groups.values())
    return (sum(x * n for x, n in weighted) / total if total else 0.0), share


def fit_contention(steps: list[list[dict]]) -> tuple[float, float]:
    """(c, the mean share of an action's time the other rank computed): per (kind, stage), an action's time
    against that share, least squares, slope over intercept; the groups' c weighted by how far their shares
    spread."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for events in steps:
        for e in events:
            start, end = e["ts"], e["ts"] + e["dur"]
            shared = sum(max(0.0, min(end, o["ts"] + o["dur"]) - max(start, o["ts"])) for o in events
                         if o["pid"] != e["pid"])
            groups.setdefault((e["cat"], e["args"]["stage"]), []).append((shared / e["dur"], e["dur"]))
    estimates = []
    for pairs in groups.values():
        mo, mt = (statistics.mean(p[i] for p in pairs) for i in (0, 1))
        spread = sum((o - mo) ** 2 for o, _ in pairs)
        if spread:
            slope = sum((o - mo) * (t - mt) for o, t in pairs) / spread
            estimates.append((slope / (mt - slope * mo), spread))
    weight = sum(w for _, w in estimates)
    overlap = statistics.mean(o for pairs in groups.values() for o, _ in pairs)
    return (sum(c * w for c, w in estimates) / weight if weight else 0.0), overlap


def fit_own_wait(rows: list[dict]) -> float:
    """k of pace = a (1 + k bubble) over the given splits' ranks (``pipeline_cost.fit_pace``, which the trainer's
    pipeline_parallel_pace_files use), 0 when every rank waited alike."""
    runs = [{"rank_bubble": r["measured"], "rank_block_s": r["block_s"]} for r in rows]
    return fit_pace(runs) if pace_spread(runs) else 0.0


def replay_idle(program: Program, table: list[list[float]], send: float, w: float) -> tuple[float, list[float]]:
    """replay's makespan and busy times, an action started over IDLE after its rank's previous one costing 1 + w."""
    clock, busy, done = [0.0] * program.num_ranks, [0.0] * program.num_ranks, {}
    pos = [0] * program.num_ranks
    while any(p < len(q) for p, q in zip(pos, program.order)):
        progressed = False
        for r, queue in enumerate(program.order):
            while pos[r] < len(queue) and all(d >= 0 and d in done for d, _ in program.deps[queue[pos[r]]]):
                a = queue[pos[r]]
                ready = max([done[d] + (send if cross else 0.0) for d, cross in program.deps[a]], default=0.0)
                kind, stage, _ = program.actions[a]
                duration = table[KIND_INDEX[kind]][stage] * (1 + w if pos[r] and ready - clock[r] > IDLE else 1.0)
                clock[r] = done[a] = max(clock[r], ready) + duration
                busy[r] += duration
                pos[r] += 1
                progressed = True
        if not progressed:
            raise Deadlock([])
    return max(clock), busy


def replay_own_wait(program: Program, table: list[list[float]], send: float, k: float) -> tuple[float, list[float]]:
    """replay's makespan and busy times, each rank's actions costing 1 + k x its own bubble (the planner's
    ``schedule_sim.replay_paced``)."""
    return replay_paced(program, table, send, k)


def replay_contention(program: Program, table: list[list[float]], send: float, c: float) -> tuple[float, list[float]]:
    """Makespan and busy times with every running action's pace divided by 1 + c x the share of the other ranks
    computing at that moment (a fluid replay: time advances to the next end or arrival)."""
    ranks = program.num_ranks
    done: dict[int, float] = {}
    pos, running, left = [0] * ranks, [None] * ranks, [0.0] * ranks
    busy, now = [0.0] * ranks, 0.0
    while any(p < len(q) for p, q in zip(pos, program.order)):
        arrival = float("inf")
        for r, queue in enumerate(program.order):
            if running[r] is None and pos[r] < len(queue):
                a = queue[pos[r]]
                if all(d >= 0 and d in done for d, _ in program.deps[a]):
                    ready = max([done[d] + (send if cross else 0.0) for d, cross in program.deps[a]], default=0.0)
                    if ready <= now:
                        kind, stage, _ = program.actions[a]
                        running[r], left[r] = a, table[KIND_INDEX[kind]][stage]
                    else:
                        arrival = min(arrival, ready)
        active = [r for r in range(ranks) if running[r] is not None]
        if not active:
            if arrival == float("inf"):
                raise Deadlock([])
            now = arrival
            continue
        pace = 1 / (1 + c * (len(active) - 1) / max(ranks - 1, 1))
        step = min(min(left[r] for r in active) / pace, arrival - now)
        now += step
        for r in active:
            left[r] -= step * pace
            busy[r] += step
            if left[r] <= 1e-12:
                done[running[r]], running[r] = now, None
                pos[r] += 1
    return now, busy


def errors(rows: list[dict], bubbles) -> tuple[float, float]:
    """Mean and worst |predicted - measured| bubble, points, over the rows' ranks."""
    e = [100 * abs(b - m) for r in rows for b, m in zip(bubbles(tuple(r["counts"])), r["measured"], strict=True)]
    return statistics.mean(e), max(e)


def judge(report: dict, keep: Path, contention: float) -> list[tuple[str, str, tuple[float, float]]]:
    """(model, its fitted figure, (mean, worst error)) for one kept group."""
    model, schedule, rows = report["model"], report["schedule"], report["rows"]
    base, timed = report["job"], report["planner_timed_steps"]
    job = plan_bench.load(base)
    program = program_for(schedule, 2, job.n_microbatches, job.pipeline.stages_per_rank)
    fitted = keep / f"{model}_{schedule}_all_boundaries" / "pipeline_costs.json"  # the planner's split's, as reported
    costs = plan_bench.load(base + ["--parallelism.pipeline_parallel_cost_file", str(fitted)]).pipeline_costs
    steps = actions_of(keep / f"{model}_{schedule}_0", timed)
    span = statistics.median(json.loads((keep / f"{model}_{schedule}_0" / "profile_traces" /
                                         f"pipeline_timeline_step{s}.json").read_text())["otherData"]["span_us"] / 1e6
                             for s in timed)
    planner = tuple(rows[0]["counts"])

    def model_errors(replayer, figure: float, scale: float, judged: list[dict]) -> tuple[float, float]:
        def play(counts, send):
            return replayer(program, [[v * scale for v in row] for row in costs.stage_table(counts)], send, figure)

        send = transfer_for_span(lambda send: play(planner, send)[0], span)

        def bubbles(counts):
            makespan, busy = play(counts, send)
            return [1 - b / makespan for b in busy]

        return errors(judged, bubbles)

    out = [("as calibrated", "", errors(rows, lambda c: [r["after"] for r in rows if tuple(r["counts"]) == c][0]))]
    w, share = fit_idle(steps)
    out.append(("after idling", f"w {w:+.3f}", model_errors(replay_idle, w, 1 / (1 + w * share), rows)))
    own = statistics.mean(rows[0]["measured"])
    k = fit_own_wait(rows[:1])
    out.append(("own wait, one run", f"k {k:+.2f}", model_errors(replay_own_wait, k, 1 / (1 + k * own), rows)))
    second = max(rows[1:], key=lambda r: abs(r["measured"][0] - r["measured"][1]))
    k2 = fit_own_wait([rows[0], second])
    others = [r for r in rows if r is not second]
    out.append(("own wait, two runs", f"k {k2:+.2f}", model_errors(replay_own_wait, k2, 1 / (1 + k2 * own), others)))
    c, overlap = fit_contention(steps)
    out.append(("both busy, fitted", f"c {c:+.3f}", model_errors(replay_contention, c, 1 / (1 + c * overlap), rows)))
    out.append(("both busy, set by hand", f"c {contention:+.3f}",
                model_errors(replay_contention, contention, 1 / (1 + contention * overlap), rows)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, required=True, help="the folder a bench_pipeline_plan --keep launch kept")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--max-splits", type=at_least(1), default=20)
    parser.add_argument("--contention", type=float, default=0.2, help="the hand-set c of the last model")
    args = parser.parse_args()
    groups = sorted(p.name.removesuffix("_steps.json").split("_", 1) for p in args.keep.glob("*_steps.json"))
    if not groups:
        parser.error(f"--keep: {args.keep} holds no launch of bench_pipeline_plan (no *_steps.json)")
    for model, schedule in groups:
        if model not in plan_bench.MODELS or schedule not in plan_bench.SCHEDULES:
            parser.error(f"--keep: {args.keep} holds a launch of {model} {schedule}, which bench_pipeline_plan"
                         f" does not run (models {', '.join(plan_bench.MODELS)})")
    args.reuse = True
    print("| model | schedule | pace model | fitted | bubble error, mean / worst (points) |\n|---|---|---|---|---|")
    for model, schedule in groups:
        try:
            report = plan_bench.run_group(model, schedule, args, args.keep)
        except plan_bench.KeptLaunchDiffers as e:
            parser.error(str(e))
        for name, figure, (mean, worst) in judge(report, args.keep, args.contention):
            print(f"| {model} | {schedule} | {name} | {figure} | {mean:.1f} / {worst:.1f} |", flush=True)


if __name__ == "__main__":
    main()
