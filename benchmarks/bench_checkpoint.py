"""Checkpoint cost: size, time the training loop is blocked (sync vs async), load time; with and without checksums.

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --ranks 2 --cases debugmodel   # FSDP over 2 CPU processes (torchrun)

Each case trains with a checkpoint every step and times the checkpointer's calls from inside the
training loop (medians over the saves after the first), with ``[checkpoint] verify`` on (sha256 of
every file at save, checked at load) and off. With ``--ranks N`` the job runs FSDP over N processes
and rank 0's figures are reported (no load time: one job per launch).
"""

import argparse
import json
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer.checkpoint as ckpt  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import main  # noqa: E402

CASES = {
    "debugmodel": ["--model.flavor", "debugmodel", "--training.local_batch_size", "2", "--training.seq_len", "128"],
    "270M": ["--model.flavor", "270M", "--training.local_batch_size", "1", "--training.seq_len", "64"],
}


def timed(cls, name, sink):
    real = getattr(cls, name)

    def wrapper(self, *a, **kw):
        start = time.perf_counter()
        out = real(self, *a, **kw)
        sink.append(time.perf_counter() - start)
        return out

    setattr(cls, name, wrapper)
    return real


def job_args(case: str, mode: str, verify: bool, steps: int, dump: Path, ranks: int) -> list[str]:
    return CASES[case] + [
        "--parallelism.data_parallel_shard_degree", str(ranks), "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000",
        "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
        "--checkpoint.no-last_save_model_only", "--checkpoint.async_mode", mode,
        "--checkpoint." + ("verify" if verify else "no-verify"), "--job.dump_folder", str(dump)]


def run(case: str, mode: str, verify: bool, steps: int, tmp: Path, ranks: int = 1) -> dict:
    dump = tmp / f"{case}_{mode}_{verify}"
    args = job_args(case, mode, verify, steps, dump, ranks)
    if ranks > 1:  # the same measurement in every rank of a torchrun launch; rank 0 writes its figures
        out = tmp / "rank0.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc_per_node={ranks}",
                               "--log-dir", str(tmp / "torchrun"), __file__, "--worker", str(out), case, mode,
                               str(verify), str(steps), str(dump), str(ranks)],
                              env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {ranks}-rank launch of {case} ({mode}) failed:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
        shutil.rmtree(dump)
        return result
    blocked, waits = [], []
    save, wait = timed(ckpt.Checkpointer, "maybe_save", blocked), timed(ckpt.Checkpointer, "wait", waits)
    try:
        result = main(load_config(overrides=args))
    finally:
        ckpt.Checkpointer.maybe_save, ckpt.Checkpointer.wait = save, wait
    folder = dump / "checkpoint" / f"step-{steps}"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    loads = []
    load = timed(ckpt.Checkpointer, "load", loads)
    try:
        main(load_config(overrides=args + ["--checkpoint.load_step", str(steps)]))
    finally:
        ckpt.Checkpointer.load = load
    shutil.rmtree(dump)
    return {"case": case, "mode": mode, "verify": verify, "size_mib": size / 2**20,
            "blocked_s": statistics.median(blocked[1:]), "step_s": statistics.median(result.step_times[1:]),
            "load_s": loads[0]}


def worker(out: Path, case: str, mode: str, verify: str, steps: str, dump: str, ranks: str) -> None:
    """Under torchrun: time this rank's checkpointer like ``run`` does in one process; rank 0 writes the figures."""
    blocked = []
    timed(ckpt.Checkpointer, "maybe_save", blocked)
    args = job_args(case, mode, verify == "True", int(steps), Path(dump), int(ranks))
    result = main(load_config(overrides=args))  # one job a launch: a second process group would need a fresh store
    folder = Path(dump) / "checkpoint" / f"step-{steps}"
    if int(os.environ.get("RANK", "0")) == 0:
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        out.write_text(json.dumps({"case": case, "mode": mode, "verify": verify == "True", "size_mib": size / 2**20,
                                   "blocked_s": statistics.median(blocked[1:]),
                                   "step_s": statistics.median(result.step_times[1:]), "load_s": None}))


def main_cli() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), *sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=at_least(1), default=5)
    parser.add_argument("--ranks", type=at_least(1), default=1, help="FSDP over this many CPU processes")
    args = parser.parse_args()
    print("| model | mode | checksums | checkpoint size (MiB) | loop blocked per save (s) | train step (s) |"
          " load (s) |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for mode in ("disabled", "async"):
                for verify in (False, True):
                    r = run(case, mode, verify, args.steps, Path(tmp), args.ranks)
                    print(f"| {r['case']} | {'sync' if mode == 'disabled' else 'async'} |"
                          f" {'on' if verify else 'off'} | {r['size_mib']:.1f} | {r['blocked_s']:.3f} |"
                          f" {r['step_s']:.3f} | {'-' if r['load_s'] is None else format(r['load_s'], '.3f')} |",
                          flush=True)


if __name__ == "__main__":
    main_cli()
