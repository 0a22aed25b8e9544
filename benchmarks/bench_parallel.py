"""Throughput and peak memory per rank under several SPMD layouts, launched with torchrun.

    python benchmarks/bench_parallel.py                          # CPU: debugmodel and 270M
    python benchmarks/bench_parallel.py --models 1B --layouts FSDP2 TP2   # on GPUs

Every layout trains the same global batch; the table shows the median step time after
warm-up, the tokens per second at that step, and the peak memory of the busiest rank. On a 2-core CPU
machine more than two ranks oversubscribe the cores: read those step times as an upper bound.
This machine's speed drifts over minutes, so with --repeats N the cases run in N passes, every
other pass in reverse order (no case always runs early or late): a case's step is the median over
its passes, and the table also gives its slowest pass over its fastest.
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
P = "--parallelism."
LAYOUTS = {
    "single": (1, []),
    "DDP2": (2, [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1"]),
    "FSDP2": (2, [P + "data_parallel_shard_degree", "2"]),
    "TP2": (2, [P + "tensor_parallel_degree", "2"]),
    "FSDP2xTP2": (4, [P + "data_parallel_shard_degree", "2", P + "tensor_parallel_degree", "2"]),
}
MODELS = {  # flavor, global batch, seq_len
    "debugmodel": ("debugmodel", 8, 256),
    "270M": ("270M", 2, 256),
    "1B": ("1B", 8, 2048),
}

WORKER = '''
import json, os, sys, resource
sys.path.insert(0, {repo!r})
from trainer.config import load_config
from trainer.train import main
from trainer.metrics import memory_gib
import torch
r = main(load_config(overrides=sys.argv[2:]))
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
json.dump({{"step_times": r.step_times, "mem": memory_gib(dev)[0]}},
          open(sys.argv[1] + os.environ.get("RANK", "0"), "w"))
'''


def launch_job(nproc: int, args: list[str], tmp: Path, tag: str, threads: int | None = None) -> list[dict]:
    """Train with ``args`` on ``nproc`` processes; every rank's step times and peak memory.

    ``threads`` per process defaults to the cores divided among the processes.
    """
    worker = tmp / "worker.py"
    worker.write_text(WORKER.format(repo=str(REPO)))
    out = tmp / f"{tag}_"
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={nproc}", str(worker), str(out),
           *args, "--job.dump_folder", str(tmp / "dump"), "--metrics.no-enable_tensorboard",
           "--metrics.log_freq", "1000"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return [json.loads((tmp / f"{out.name}{r}").read_text()) for r in range(nproc)]


def alternating(cases: list, repeats: int) -> list:
    """``cases`` ``repeats`` times over, every other pass reversed."""
    return [case for p in range(repeats) for case in (cases if p % 2 == 0 else cases[::-1])]


def run(model: str, layout: str, steps: int, tmp: Path) -> dict:
    flavor, global_batch, seq = MODELS[model]
    nproc, overrides = LAYOUTS[layout]
    dp = nproc // (2 if "TP2" in layout else 1)
    args = [
        "--model.flavor", flavor, "--training.seq_len", str(seq), "--training.global_batch_size", str(global_batch),
        "--training.local_batch_size", str(global_batch // dp), "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", "1", *overrides,
    ]
    ranks = launch_job(nproc, args, tmp, f"{model}_{layout}")
    median = statistics.median(ranks[0]["step_times"][2:])
    return {
        "model": model, "layout": layout, "ranks": nproc, "median_step_s": median,
        "tokens_per_s": global_batch * seq / median, "peak_mem_gib_max_rank": max(r["mem"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["debugmodel", "270M"], choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=at_least(3), default=7)
    parser.add_argument("--repeats", type=at_least(1), default=1,
                        help="passes over the cases, every other one reversed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [(model, layout) for model in args.models for layout in args.layouts]
    runs: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for model, layout in alternating(cases, args.repeats):
            r = run(model, layout, args.steps, Path(tmp))
            runs[(model, layout)].append(r)
            print(f"  {model} {layout}: {r['median_step_s']:.3f} s", file=sys.stderr, flush=True)
    rows = []
    for case in cases:
        passes = runs[case]
        steps = [r["median_step_s"] for r in passes]
        median = statistics.median(steps)
        rows.append({**passes[0], "median_step_s": median, "pass_steps_s": steps,
                     "tokens_per_s": MODELS[case[0]][1] * MODELS[case[0]][2] / median,
                     "peak_mem_gib_max_rank": max(r["peak_mem_gib_max_rank"] for r in passes)})
        r = rows[-1]
        print(f"| {r['model']} | {r['layout']} | {r['ranks']} | {median:.3f} | {max(steps) / min(steps):.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['peak_mem_gib_max_rank']:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    print("| model | layout | ranks | median step (s) | slowest / fastest pass | tokens/s at the median step"
          " | peak memory, max rank (GiB) |")
    print("|---|---|---|---|---|---|---|")
    main()
