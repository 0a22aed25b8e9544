"""Pipeline schedules against the ideal: step time per schedule at pp 2 and 4.

    python benchmarks/bench_pipeline.py

A Llama with dim 512 and 8 layers (vocabulary 2048, so the blocks dominate the compute), 8
sequences of 128 tokens per step split into 8 microbatches. Every process gets one thread;
the single-process step (also one thread) divided by pp is the ideal. The theoretical bubble
comes from trainer.parallel.schedule_sim (F=1, B=2, I=W=1, no communication), so the
expected time is ideal / (1 - bubble). With more ranks than cores (pp 4 on a 2-core machine)
the ranks share cores and the measured time cannot reach the ideal.

Steps after the warm-up are also timed action by action ([profiling] pipeline_timeline_steps). For
each timed step: its pipeline span (first action start to last action end over the ranks), the
bubble model built from the measured per-stage times (the schedule replayed with the median
measured duration of each action kind on each stage, communication free:
trainer.parallel.schedule_sim.replayed_span), and each pipeline rank's measured bubble; the table
gives their medians over the timed steps. span/model above 1 is what communication and
scheduling overhead add to the compute the schedule orders.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_parallel import launch_job  # noqa: E402

from trainer.config.schedules import SCHEDULES  # noqa: E402
from trainer.parallel.schedule_sim import bubble_fraction  # noqa: E402

MODEL = [
    "--model.overrides.dim", "512", "--model.overrides.n_layers", "8", "--model.overrides.n_heads", "8",
    "--model.overrides.n_kv_heads", "8", "--training.seq_len", "128", "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "1",
]


def median_step(ranks: list[dict], warmup: int) -> float:
    return statistics.median(ranks[0]["step_times"][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        steps = ["--training.steps", str(args.steps)]
        # One thread, like each pipeline rank: the baseline the ideal is computed from.
        single = median_step(launch_job(1, MODEL + steps, tmp, "single", threads=1), args.warmup)
        print(f"single process (1 thread): {single:.3f} s/step\n")
        print("| pp | schedule | stages/rank | measured step (s) | ideal = single/pp (s) | measured/ideal "
              "| theoretical bubble | pipeline span (s) | model from measured action times (s) | span/model "
              "| measured bubble per pp rank |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        timed = list(range(args.warmup + 1, args.steps + 1))
        for pp in args.pp:
            for schedule in args.schedules:
                spr = 1 if SCHEDULES[schedule].stages_per_rank == "one" else 2
                overrides = ["--parallelism.pipeline_parallel_degree", str(pp),
                             "--parallelism.pipeline_parallel_schedule", schedule,
                             "--profiling.pipeline_timeline_steps", ",".join(map(str, timed))]
                ranks = launch_job(pp, MODEL + steps + overrides, tmp, f"{pp}_{schedule}", threads=1)
                measured = median_step(ranks, args.warmup)
                ideal = single / pp
                bubble = bubble_fraction(schedule, pp, 8, spr)
                traces = [json.loads((tmp / "dump" / "profile_traces" / f"pipeline_timeline_step{s}.json").read_text())
                          ["otherData"] for s in timed]
                span = statistics.median(t["span_us"] for t in traces) / 1e6
                model = statistics.median(t["model_span_us"] for t in traces) / 1e6
                ratio = statistics.median(t["span_us"] / t["model_span_us"] for t in traces)
                per_rank = " / ".join(f"{100 * statistics.median(t['bubble'][str(r)] for t in traces):.0f}%"
                                      for r in range(pp))
                print(f"| {pp} | {schedule} | {spr} | {measured:.3f} | {ideal:.3f} | {measured / ideal:.2f} "
                      f"| {100 * bubble:.1f}% | {span:.3f} | {model:.3f} | {ratio:.3f} | {per_rank} |", flush=True)

if __name__ == "__main__":
    main()
