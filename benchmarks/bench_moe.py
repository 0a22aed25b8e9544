"""The MoE family: expert compute kernels, and training throughput with and without expert parallelism.

    python benchmarks/bench_moe.py                       # CPU: both tables (docs/performance.md)
    python benchmarks/bench_moe.py --layouts single EP2 --flavor debugmodel_shared

1. Expert compute, forward + backward of one MoE layer's experts on a fixed token grouping:
   the per-expert loop (the CPU path) against ``torch._grouped_mm`` (the CUDA bf16 path; on a CPU
   build it runs in fp32 and is timed only to show whether it would help there).
2. Training the debug MoE model (configs/debug_moe.toml) on the same global batch in several
   layouts, launched with torchrun over gloo: one process, FSDP 2 (every rank holds all experts,
   sharded), EP 2 (each rank holds half the experts inside FSDP 2; tokens travel by all-to-all).
   Median step after warm-up, tokens/s, peak memory of the busiest rank.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_parallel import launch_job  # noqa: E402
from trainer.models.moe.model import grouped_swiglu, looped_swiglu  # noqa: E402

P = "--parallelism."
LAYOUTS = {
    "single": (1, []),
    "FSDP2": (2, [P + "data_parallel_shard_degree", "2"]),
    "EP2": (2, [P + "data_parallel_shard_degree", "2", P + "expert_parallel_degree", "2"]),
}


def time_experts(kernel, tokens: int, dim: int, hidden: int, n_experts: int, repeats: int,
                 device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of forward + backward for ``tokens`` rows spread unevenly over the experts (on CUDA the
    device is synchronised around each repeat)."""
    g = torch.Generator().manual_seed(0)
    # an uneven grouping with one empty expert, like a real router's
    weights = torch.rand(n_experts, generator=g)
    weights[-1] = 0
    counts = torch.floor(weights / weights.sum() * tokens).long()
    counts[0] += tokens - counts.sum()

    def make(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()

    x = make(tokens, dim)
    w1, w3 = make(n_experts, hidden, dim, scale=dim**-0.5), make(n_experts, hidden, dim, scale=dim**-0.5)
    w2 = make(n_experts, dim, hidden, scale=hidden**-0.5)
    grad = make(tokens, dim).detach()  # dense: the CPU grouped kernel refuses an expanded one
    counts = counts.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 2):
        sync()
        start = time.perf_counter()
        kernel(x, counts, w1, w2, w3).backward(grad)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_table(repeats: int) -> None:
    print("| experts x (dim, hidden) | routed rows | per-expert loop (ms) | torch._grouped_mm (ms) | loop / grouped |")
    print("|---|---:|---:|---:|---:|")
    for n_experts, dim, hidden, tokens in [(8, 256, 128, 4096), (64, 256, 128, 4096), (128, 1024, 384, 8192)]:
        loop = time_experts(looped_swiglu, tokens, dim, hidden, n_experts, repeats)
        try:
            grouped = time_experts(grouped_swiglu, tokens, dim, hidden, n_experts, repeats)
            cells = f"{grouped * 1e3:.1f} | {loop / grouped:.2f}"
        except RuntimeError as e:  # a build without a CPU kernel for it
            cells = f"n/a ({str(e).splitlines()[0][:60]}) | -"
        print(f"| {n_experts} x ({dim}, {hidden}) | {tokens} | {loop * 1e3:.1f} | {cells} |", flush=True)


def train_table(flavor: str, layouts: list[str], steps: int, batch: int, seq: int) -> list[dict]:
    print("\n| flavor | layout | ranks | median step (s) | tokens/s (job) | peak memory, max rank (GiB) |")
    print("|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            nproc, overrides = LAYOUTS[layout]
            args = ["--job.config_file", "configs/debug_moe.toml", "--model.flavor", flavor,
                    "--training.seq_len", str(seq), "--training.global_batch_size", str(batch),
                    "--training.local_batch_size", str(batch // nproc), "--training.steps", str(steps),
                    "--lr_scheduler.warmup_steps", "1", "--validation.no-enable", *overrides]
            ranks = launch_job(nproc, args, Path(tmp), f"{flavor}_{layout}")
            median = statistics.median(ranks[0]["step_times"][2:])
            row = {"flavor": flavor, "layout": layout, "ranks": nproc, "median_step_s": median,
                   "tokens_per_s": batch * seq / median, "peak_mem_gib_max_rank": max(r["mem"] for r in ranks)}
            rows.append(row)
            print(f"| {flavor} | {layout} | {nproc} | {median:.3f} | {row['tokens_per_s']:.0f} | "
                  f"{row['peak_mem_gib_max_rank']:.2f} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=at_least(1), default=8)
    parser.add_argument("--batch", type=at_least(1), default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=at_least(1), default=256)
    parser.add_argument("--repeats", type=at_least(1), default=9, help="timed repeats per kernel")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.no_kernels:
        kernel_table(args.repeats)
    rows = train_table(args.flavor, args.layouts, args.steps, args.batch, args.seq)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
