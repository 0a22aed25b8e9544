"""Single-process training throughput: tokens/s, step time and peak memory per model size.

    python benchmarks/bench_train.py                 # CPU table for docs/performance.md
    python benchmarks/bench_train.py --cases 1B-bf16 # on a GPU

Each case trains in-process for a few steps; the first `--warmup` steps are dropped and the
median of the rest is reported. Run cases in one invocation to compare them: this machine is
shared and noisy, so only ratios within one run mean much.

The ideal it is held against: the measured matmul peak of this device (a square matmul of
``--peak-size`` in the case's dtype, median of repeats, on all the threads torch uses); "of peak"
is the model FLOPs the step achieves divided by that peak.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from arguments import at_least, check_timed_steps  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.config import load_config  # noqa: E402
from trainer.metrics import memory_gib  # noqa: E402
from trainer.models import get_model_spec, resolve_model_args  # noqa: E402
from trainer.train import main  # noqa: E402

CASES = {
    "debugmodel": ["--model.flavor", "debugmodel", "--training.local_batch_size", "8", "--training.seq_len", "256"],
    "270M": ["--model.flavor", "270M", "--training.local_batch_size", "2", "--training.seq_len", "256"],
    "1B-bf16": ["--model.flavor", "1B", "--training.local_batch_size", "4", "--training.seq_len", "2048",
                "--training.mixed_precision_param", "bfloat16", "--optimizer.implementation", "fused"],
}


def matmul_peak(dtype: torch.dtype, size: int, device: torch.device, repeats: int = 20) -> float:
    """FLOP/s of a (size x size) @ (size x size) matmul: the device's practical peak for this dtype."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def run_case(name: str, steps: int, warmup: int, out: Path, extra: list[str], peak_size: int) -> dict:
    args = CASES[name] + extra + [
        "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable_tensorboard",
        "--metrics.log_freq", "1000", "--job.dump_folder", str(out / name),
    ]
    config = load_config(overrides=args)
    result = main(config)
    times = result.step_times[warmup:]
    tokens = config.training.local_batch_size * config.training.seq_len
    median = statistics.median(times)
    spec = get_model_spec(config.model.name)
    flops = spec.flops_per_token(resolve_model_args(spec, config.model), config.training.seq_len)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mem, mem_kind = memory_gib(device)
    dtype = torch.float32 if config.training.mixed_precision_param in ("float32", "auto") and device.type == "cpu" \
        else torch.bfloat16
    peak = matmul_peak(dtype, peak_size, device)
    return {
        "case": name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "tokens_per_step": tokens,
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "achieved_tflops": tokens / median * flops / 1e12,
        "matmul_peak_tflops": peak / 1e12,
        "of_peak": tokens / median * flops / peak,
        "peak_memory_gib": mem,
        "memory_kind": mem_kind,
        "steps_measured": len(times),
    }


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["debugmodel", "270M"], choices=list(CASES))
    parser.add_argument("--steps", type=at_least(1), default=8)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench"))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--peak-size", type=at_least(1), default=2048, help="matmul size for the device's peak")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="config overrides for every case")
    args = parser.parse_args()
    check_timed_steps(parser, args)
    rows = [run_case(c, args.steps, args.warmup, args.out, args.extra, args.peak_size) for c in args.cases]
    print("| case | device | tokens/step | median step (s) | tokens/s | achieved TFLOP/s | matmul peak TFLOP/s |"
          " of peak | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['device']} | {r['tokens_per_step']} | {r['median_step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['achieved_tflops']:.3f} | {r['matmul_peak_tflops']:.3f} | "
            f"{100 * r['of_peak']:.0f}% | {r['peak_memory_gib']:.2f} ({r['memory_kind']}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main_cli()
