"""Pipeline schedules against the ideal: step time per schedule at pp 2 and 4.

    python benchmarks/bench_pipeline.py

A Llama with dim 512 and 8 layers (vocabulary 2048, so the blocks dominate the compute), 8
sequences of 128 tokens per step split into 8 microbatches. Every process gets one thread;
the single-process step (also one thread) divided by pp is the ideal. The theoretical bubble
comes from trainer.pipeline.simulate (F=1, B=2, I=W=1, no communication), so the
expected time is ideal / (1 - bubble). With more ranks than cores (pp 4 on a 2-core machine)
the ranks share cores and the measured time cannot reach the ideal.

Steps after the warm-up are also timed action by action ([profiling] pipeline_timeline_steps). For
each timed step: its pipeline span (first action start to last action end over the ranks), the
bubble model built from the measured per-stage times (the schedule replayed with the median
measured duration of each action kind on each stage, communication free:
trainer.pipeline.simulate.replayed_span), and each pipeline rank's measured bubble; the table
gives their medians over the timed steps. span/model above 1 is what communication and
scheduling overhead add to the compute the schedule orders.

This machine's speed drifts over minutes, so with --repeats N every case (the single process
included) runs in N passes, every other pass in reverse order: the figures are medians over the
passes, and the measured step's slowest pass over its fastest is given.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from arguments import at_least, check_timed_steps  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_parallel import alternating, launch_job  # noqa: E402

from trainer.config.schedules import SCHEDULES  # noqa: E402
from trainer.pipeline.simulate import bubble_fraction  # noqa: E402

MODEL = [
    "--model.overrides.dim", "512", "--model.overrides.n_layers", "8", "--model.overrides.n_heads", "8",
    "--model.overrides.n_kv_heads", "8", "--training.seq_len", "128", "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "1",
]


def median_step(ranks: list[dict], warmup: int) -> float:
    return statistics.median(ranks[0]["step_times"][warmup:])


def run_case(pp: int, schedule: str, steps: list[str], timed: list[int], warmup: int, tmp: Path) -> dict:
    """One launch of ``schedule`` at ``pp``: its median step and its timeline's medians over the timed steps."""
    overrides = ["--parallelism.pipeline_parallel_degree", str(pp),
                 "--parallelism.pipeline_parallel_schedule", schedule,
                 "--profiling.pipeline_timeline_steps", ",".join(map(str, timed))]
    ranks = launch_job(pp, MODEL + steps + overrides, tmp, f"{pp}_{schedule}", threads=1)
    traces = [json.loads((tmp / "dump" / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())
              ["otherData"] for s in timed]
    return {"step": median_step(ranks, warmup),
            "span": statistics.median(t["span_us"] for t in traces) / 1e6,
            "model": statistics.median(t["model_span_us"] for t in traces) / 1e6,
            "ratio": statistics.median(t["span_us"] / t["model_span_us"] for t in traces),
            "bubble": [statistics.median(t["bubble"][str(r)] for t in traces) for r in range(pp)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", nargs="+", type=at_least(1), default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--steps", type=at_least(1), default=5)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=1,
                        help="passes over the cases, every other one reversed")
    args = parser.parse_args()
    check_timed_steps(parser, args)
    steps = ["--training.steps", str(args.steps)]
    timed = list(range(args.warmup + 1, args.steps + 1))
    cases = [("single", 1)] + [(schedule, pp) for pp in args.pp for schedule in args.schedules]
    runs: dict[tuple[str, int], list] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for schedule, pp in alternating(cases, args.repeats):
            if schedule == "single":  # one thread, like each pipeline rank: the baseline of the ideal
                runs[(schedule, pp)].append(median_step(launch_job(1, MODEL + steps, tmp, "single", threads=1),
                                                        args.warmup))
            else:
                runs[(schedule, pp)].append(run_case(pp, schedule, steps, timed, args.warmup, tmp))
    single = statistics.median(runs[("single", 1)])
    print(f"single process (1 thread): {single:.3f} s/step (slowest / fastest pass"
          f" {max(runs[('single', 1)]) / min(runs[('single', 1)]):.3f})\n")
    print("| pp | schedule | stages/rank | measured step (s) | slowest / fastest pass | ideal = single/pp (s)"
          " | measured/ideal | theoretical bubble | pipeline span (s) | model from measured action times (s)"
          " | span/model | measured bubble per pp rank |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for schedule, pp in cases[1:]:
        passes = runs[(schedule, pp)]
        spr = 1 if SCHEDULES[schedule].stages_per_rank == "one" else 2

        def mid(key):
            return statistics.median(p[key] for p in passes)

        measured, ideal = mid("step"), single / pp
        spread = max(p["step"] for p in passes) / min(p["step"] for p in passes)
        per_rank = " / ".join(f"{100 * statistics.median(p['bubble'][r] for p in passes):.0f}%" for r in range(pp))
        print(f"| {pp} | {schedule} | {spr} | {measured:.3f} | {spread:.3f}"
              f" | {ideal:.3f} | {measured / ideal:.2f} | {100 * bubble_fraction(schedule, pp, 8, spr):.1f}%"
              f" | {mid('span'):.3f} | {mid('model'):.3f} | {mid('ratio'):.3f} | {per_rank} |", flush=True)


if __name__ == "__main__":
    main()
