"""Where a data-parallel step's time goes: each phase of ``train_step`` timed on every rank, against one process.

    python benchmarks/bench_dp_overhead.py                      # the peer benchmark's shape, seq 512 x 8
    python benchmarks/bench_dp_overhead.py --seq-len 1024 --local-batch 4 --layouts DDP2

Layouts: ``1proc`` (one process, one thread: what each rank of a 2-rank job computes),
``2x1proc`` (two independent single processes at once: the same work plus the machine's own
contention, no communication), ``DDP2`` and ``FSDP2`` (each rank one thread). Per layout the
table gives rank 0's median over steps 3.. of: the step, backward (with whatever the data-parallel
hooks do inside it), the token-count and loss all-reduces, the gradient scaling, clipping, the
optimizer, and forward as the rest. A data-parallel layout's overhead is its step minus
``2x1proc``'s. The shape is the Llama of ../shared/peer (dim 256, 6 layers, 16/16 heads, ffn 768,
vocabulary 2048 of the bundled tokenizer's), fp32, no activation checkpointing, bundled data.
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
LAYOUTS = {  # name -> (processes per job, jobs at once, overrides)
    "1proc": (1, 1, []),
    "2x1proc": (1, 2, []),
    "DDP2": (2, 1, [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1"]),
    "FSDP2": (2, 1, [P + "data_parallel_shard_degree", "2"]),
}
PHASES = ["step", "backward", "all-reduces", "scale", "clip", "optimizer", "forward + rest"]

WORKER = '''
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch
import trainer.optim
import trainer.train as T
from trainer.config import load_config

times, inside = {{}}, []

def timed(name, fn):
    def wrapper(*args, **kwargs):
        inside.append(name)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            inside.pop()
            if all(n == "step" for n in inside):  # not inside another timed phase
                times.setdefault(name, []).append(time.perf_counter() - start)
    return wrapper

T.train_step = timed("step", T.train_step)
T.clip_grad_norm_ = timed("clip", T.clip_grad_norm_)
T.all_reduce_sum = timed("all-reduces", T.all_reduce_sum)
torch.Tensor.backward = timed("backward", torch.Tensor.backward)
torch._foreach_mul_ = timed("scale", torch._foreach_mul_)  # inside clip it counts as clip
for method in ("step", "zero_grad"):
    setattr(trainer.optim.ChunkOptimizers, method, timed("optimizer", getattr(trainer.optim.ChunkOptimizers, method)))
T.main(load_config(overrides=sys.argv[2:]))
json.dump(times, open(sys.argv[1] + os.environ.get("RANK", "0"), "w"))
'''


def run_layout(name: str, args: list[str], tmp: Path) -> dict[str, float]:
    """Rank 0's (first job's) median seconds per phase over steps 3.. of one layout."""
    nproc, jobs, extra = LAYOUTS[name]
    worker = tmp / "worker.py"
    worker.write_text(WORKER.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for j in range(jobs):
        out = tmp / f"{name}_{j}_"
        cmd = [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={nproc}", str(worker),
               str(out), *args, *extra, "--job.dump_folder", str(tmp / f"dump_{name}_{j}")]
        procs.append((out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    for _, p in procs:
        log, _ = p.communicate()
        if p.returncode != 0:
            sys.exit(f"{name} failed:\n{log[-3000:]}")
    times = json.loads(Path(f"{procs[0][0]}0").read_text())
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    med["all-reduces"] = med.get("all-reduces", 0.0)
    med["forward + rest"] = med["step"] - sum(med[k] for k in PHASES[1:-1])
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--seq-len", type=at_least(1), default=512)
    ap.add_argument("--local-batch", type=at_least(1), default=8)
    ap.add_argument("--steps", type=at_least(1), default=8)
    a = ap.parse_args()
    args = ["--job.config_file", str(REPO / "configs/debug_model.toml"), "--model.overrides.n_kv_heads", "16",
            "--model.overrides.multiple_of", "256", "--training.mixed_precision_param", "float32",
            "--activation_checkpoint.mode", "none", "--training.seq_len", str(a.seq_len),
            "--training.local_batch_size", str(a.local_batch), "--training.steps", str(a.steps),
            "--validation.no-enable", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts:
            rows[name] = run_layout(name, args, Path(tmp))
            print(f"{name}: step {rows[name]['step'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    print(f"seq {a.seq_len} x local batch {a.local_batch}, rank 0, median ms over steps 3-{a.steps}, one thread per"
          " process\n")
    print("| layout | " + " | ".join(PHASES) + " |")
    print("|---" * (len(PHASES) + 1) + "|")
    for name, med in rows.items():
        print(f"| {name} | " + " | ".join(f"{med[k] * 1e3:.1f}" for k in PHASES) + " |")


if __name__ == "__main__":
    main()
