"""Context parallelism at long sequences: activation memory and step time per rank for cp = 1, 2, 4.

    python benchmarks/bench_cp.py                       # debug model, one 8192-token sequence per step
    python benchmarks/bench_cp.py --seq-len 16384 --cp 1 2 4 8   # on GPUs

Each run trains the same batch (one sequence per step); with cp = C every rank holds seq/C tokens
of it. Columns: what autograd saves for backward in one forward on the busiest rank (the
activation memory, counted by saved-tensor hooks over unique storages), the busiest rank's peak
memory (resident set on CPU, allocated on GPU: includes the runtime and the allocator's slack),
and the median step time. On a 2-core CPU machine cp = 4 oversubscribes the cores: read its
step time as an upper bound.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from arguments import at_least, check_timed_steps  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_parallel import REPO, launch_job  # noqa: E402

PROBE = '''
import json, os, sys
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from trainer.config import load_config
from trainer.env import init_device
from trainer.parallel.mesh import init_distributed
from trainer.plan import build_job_plan
from trainer.train import build_trainer, summed_loss

config = load_config(overrides=sys.argv[2:])
plan = build_job_plan(config, int(os.environ.get("WORLD_SIZE", 1)))
device = init_device(int(os.environ.get("LOCAL_RANK", 0)))
if plan.dims.world_size > 1:
    init_distributed(device, 300)
trainer = build_trainer(plan, device, False)
x, y = trainer.loader.next_step()[0]
[kwargs] = trainer.parts.shard_inputs([{{k: v.to(device) for k, v in trainer.model_kwargs(x).items()}}])
x, y = x.to(device), y.to(device)
[(x, y)] = trainer.parts.shard_batch([(x, y)])
storages = {{}}
def pack(t):
    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer.step_context():
    summed_loss(trainer.parts.chunks[0](x, **kwargs), y)
json.dump({{"saved": sum(storages.values())}}, open(sys.argv[1] + os.environ.get("RANK", "0"), "w"))
if dist.is_initialized():
    dist.destroy_process_group()
'''


def saved_bytes(cp: int, overrides: list[str], tmp: Path) -> float:
    probe = tmp / "probe.py"
    probe.write_text(PROBE.format(repo=str(REPO)))
    out = tmp / f"saved{cp}_"
    cmd = [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={cp}", str(probe), str(out),
           *overrides, "--job.dump_folder", str(tmp / "dump"), "--metrics.no-enable_tensorboard"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return max(json.loads((tmp / f"{out.name}{r}").read_text())["saved"] for r in range(cp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=at_least(1), default=8192)
    parser.add_argument("--cp", nargs="+", type=at_least(1), default=[1, 2, 4])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=at_least(1), default=3)
    parser.add_argument("--warmup", type=at_least(0), default=1)
    args = parser.parse_args()
    check_timed_steps(parser, args)
    print("| cp | tokens per rank | saved activations, busiest rank (GiB) | peak memory, busiest rank (GiB)"
          " | median step (s) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            overrides = ["--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
                         "--training.local_batch_size", "1", "--training.steps", str(args.steps),
                         "--lr_scheduler.warmup_steps", "1", "--model.attn_mask_type", "causal",
                         "--parallelism.context_parallel_degree", str(cp)]
            saved = saved_bytes(cp, overrides, Path(tmp))
            ranks = launch_job(cp, overrides, Path(tmp), f"cp{cp}")
            step = statistics.median(ranks[0]["step_times"][args.warmup:])
            mem = max(r["mem"] for r in ranks)
            print(f"| {cp} | {args.seq_len // cp} | {saved / 2**30:.2f} | {mem:.2f} | {step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
