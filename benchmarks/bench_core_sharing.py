"""Whether one CPU process slows another: each part of the model timed alone and beside a second process.

    python benchmarks/bench_core_sharing.py [--models debug 12x32k] [--rounds 3] [--steps 20]

A pipeline on CPU runs one process per rank, each on its own core (OMP_NUM_THREADS=1). In the planner
benchmark, a rank that hardly waited ran its blocks faster when the other rank waited much than when both
were busy (bench_pipeline_plan.py's fourth table). One explanation would be cores that do not compute
independently (a shared cache, memory bandwidth, clock or a hypervisor's scheduling). This tests it
without a pipeline: ``python -m trainer.measure_costs`` (each part's forward and backward, medians of
--steps microbatches) run alone, and run twice at once (two processes started together, each timing the
same parts), in alternating order for --rounds rounds. Reported per model: a block's forward and backward
and the output part's (milliseconds, the median over rounds; beside = the two concurrent processes' mean)
and beside / alone (above 1: a second process slows the first). Figures: docs/performance.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "debug": [],
    "12x32k": ["--model.overrides.n_layers", "12", "--model.overrides.vocab_size", "32768"],
}
# what the pipeline benchmark's ranks run: one microbatch of one sequence
JOB = ["--job.config_file", str(REPO / "configs/debug_model.toml"), "--parallelism.pipeline_parallel_microbatch_size",
       "1"]


def start(model: str, steps: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer.measure_costs", *JOB, *MODELS[model], "--device", "cpu",
                             "--steps", str(steps), "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def parts(path: Path) -> dict[str, float]:
    """Seconds per microbatch: the mean block's forward and backward, the output part's forward and backward."""
    measured = json.loads(path.read_text())["measured"]["parts_s"]
    return {"block F": statistics.fmean(measured["F"][1:-1]), "block B": statistics.fmean(measured["B"][1:-1]),
            "output F": measured["F"][-1], "output B": measured["B"][-1]}


def finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(err[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--steps", type=at_least(1), default=20, help="microbatches each timing takes (after two)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; each process OMP_NUM_THREADS=1; ms per microbatch of 1 x 256 tokens, medians"
          f" over {args.rounds} rounds (alone and beside in alternating order)\n")
    print("| model | part | alone (ms) | beside a second process (ms) | beside / alone |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            alone, beside = [], []
            for k in range(args.rounds):
                for mode in (("alone", "beside") if k % 2 == 0 else ("beside", "alone")):
                    outs = [Path(tmp) / f"{model}_{k}_{mode}_{i}.json" for i in range(1 if mode == "alone" else 2)]
                    finish([start(model, args.steps, out) for out in outs])
                    timed = [parts(out) for out in outs]
                    mean = {key: statistics.fmean(t[key] for t in timed) for key in timed[0]}
                    (alone if mode == "alone" else beside).append(mean)
            for key in alone[0]:
                a = statistics.median(r[key] for r in alone)
                b = statistics.median(r[key] for r in beside)
                print(f"| {model} | {key} | {1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
