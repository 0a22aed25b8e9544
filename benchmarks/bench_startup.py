"""Start-up: seconds from launching a command to the debug model's first step line.

    python benchmarks/bench_startup.py              # prints a markdown table (docs/performance.md)

Each launcher runs the default debug config (configs/debug_model.toml) for one step, reading its
output as it comes; the clock stops at the line of step 1. The first launch of each command
prepares the bundled data into a new dump folder's cache ("cold"); the next ones reuse it
("warm", median of the repeats). Python writes and reuses bytecode caches as it does for users
(PYTHONDONTWRITEBYTECODE, set on some build machines, is dropped for the launched commands: without
the caches every launch compiles the trainer's modules again, ~0.15 s measured).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
STEP1 = re.compile(r"step\s+1\s+loss")

COMMANDS = {
    "python train.py (1 process)": ([sys.executable, "train.py"], {}),
    "./run_train.sh (1 process)": (["./run_train.sh"], {"NGPU": "1"}),
    "NGPU=2 ./run_train.sh (FSDP 2)": (["./run_train.sh"], {"NGPU": "2"}),
}


def time_to_first_step(cmd: list[str], env: dict, dump: Path) -> float:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHON": sys.executable, **env}
    if env.get("NGPU", "1") != "1":
        env["OMP_NUM_THREADS"] = "1"  # what torchrun sets for several processes anyway, without its warning
    start = time.perf_counter()
    proc = subprocess.Popen(cmd + ["--training.steps", "1", "--validation.no-enable", "--job.dump_folder", str(dump)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = None
    for line in proc.stdout:
        if seen is None and STEP1.search(line):
            seen = time.perf_counter() - start
    proc.wait()
    if proc.returncode != 0 or seen is None:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode})")
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(1), default=5, help="warm launches per command")
    args = ap.parse_args()
    print("| command | cold: first launch (s) | warm: median of later launches (s) |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (cmd, env)) in enumerate(COMMANDS.items()):
            dump = Path(tmp) / f"run{i}"
            cold = time_to_first_step(cmd, env, dump)
            warm = statistics.median(time_to_first_step(cmd, env, dump) for _ in range(args.repeats))
            print(f"| `{name}` | {cold:.2f} | {warm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
