"""The plan's activation-memory estimate against what autograd actually saves, per layout and schedule.

    python benchmarks/bench_activation_memory.py            # markdown table (docs/pipeline.md)

Each layout trains the debug model (configs/debug_model.toml) for 2 steps with
``[profiling] activation_memory_steps = [2]``: every rank counts the bytes its saved-tensor hooks
see (each storage once, parameters excluded) and the reporting rank logs the busiest rank of each
pipeline rank next to the estimate (trainer/activation_memory.py). The table shows both per pipeline
rank and their ratio. Activation checkpointing is left out: the hooks cannot see what the
checkpoint keeps.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
P = "--parallelism."


def pp(n: int, schedule: str, *extra: str) -> list[str]:
    return [P + "pipeline_parallel_degree", str(n), P + "pipeline_parallel_schedule", schedule, *extra]


LAYOUTS = {  # name: (ranks, overrides)
    "single": (1, []),
    "accumulation 2": (1, ["--training.global_batch_size", "16"]),
    "FSDP2": (2, [P + "data_parallel_shard_degree", "2"]),
    "TP2": (2, [P + "tensor_parallel_degree", "2", P + "no-enable_sequence_parallel"]),
    "TP2 + SP": (2, [P + "tensor_parallel_degree", "2"]),
    "PP2 GPipe": (2, pp(2, "GPipe")),
    "PP2 1F1B": (2, pp(2, "1F1B")),
    "PP2 Interleaved1F1B": (2, pp(2, "Interleaved1F1B")),
    "PP2 InterleavedZeroBubble": (2, pp(2, "InterleavedZeroBubble")),
    "PP2 ZBVZeroBubble": (2, pp(2, "ZBVZeroBubble")),
    "PP2 DualPipeV": (2, pp(2, "DualPipeV")),
    "PP4 1F1B": (4, pp(4, "1F1B")),
    "PP4 ZBVZeroBubble": (4, pp(4, "ZBVZeroBubble", "--model.overrides.n_layers", "8")),
    "PP2 x FSDP2 ZBV": (4, pp(2, "ZBVZeroBubble", P + "data_parallel_shard_degree", "2")),
}
LINE = re.compile(r"saved activations, pp rank (\d+): peak ([\d,.]+) MiB \(estimate ([\d,.]+) MiB\)")


def measure(nproc: int, overrides: list[str], dump: Path) -> list[tuple[int, float, float]]:
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={nproc}", "train.py",
           "--training.steps", "2", "--profiling.activation_memory_steps", "2", "--validation.no-enable",
           "--metrics.no-enable_tensorboard", "--job.dump_folder", str(dump), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return [(int(r), float(m.replace(",", "")), float(e.replace(",", "")))
            for r, m, e in LINE.findall(proc.stdout + proc.stderr)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    print("| layout | ranks | pp rank | measured (MiB) | estimate (MiB) | estimate / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            nproc, overrides = LAYOUTS[name]
            for rank, measured, estimate in measure(nproc, overrides, Path(tmp) / "dump"):
                print(f"| {name} | {nproc} | {rank} | {measured:.1f} | {estimate:.1f} | {estimate / measured:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
