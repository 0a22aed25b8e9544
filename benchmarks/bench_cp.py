"""Context parallelism at long sequences: peak memory per rank and step time for cp = 1, 2, 4.

    python benchmarks/bench_cp.py                       # debug model, one 4096-token sequence per step
    python benchmarks/bench_cp.py --seq-len 16384 --cp 1 2 4 8   # on GPUs

Each run trains the same batch (one sequence per step); with cp = C every rank holds seq/C tokens
of it. Memory is the busiest rank's peak (resident set on CPU, allocated memory on GPU). On a
2-core CPU machine cp = 4 oversubscribes the cores: read its step time as an upper bound.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import launch_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    print(f"| cp | ranks | tokens per rank | median step (s) | peak memory, busiest rank (GiB) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            overrides = ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
                         "--training.local_batch_size", "1", "--training.steps", str(args.steps),
                         "--lr_scheduler.warmup_steps", "1", "--parallelism.context_parallel_degree", str(cp)]
            ranks = launch_job(cp, overrides, Path(tmp), f"cp{cp}")
            step = statistics.median(ranks[0]["step_times"][args.warmup:])
            mem = max(r["mem"] for r in ranks)
            print(f"| {cp} | {cp} | {args.seq_len // cp} | {step:.2f} | {mem:.2f} |", flush=True)


if __name__ == "__main__":
    main()
