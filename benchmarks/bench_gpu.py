"""Everything a lent GPU is for, in one call that fits its lease (issue 32; figures in docs/performance.md "GPU").

    python3 benchmarks/bench_gpu.py --out DIR [--budget 480] [--data gpu/data] [--tokenizer gpu/cl100k_base.tiktoken]
    python3 benchmarks/bench_gpu.py --smoke --out DIR   # the same steps on this CPU, tiny: checks the script itself

Steps, in order of what matters most, each in its own process group with a time cap, skipped when the budget
left is too small (said so in the summary):
  env        the device, driver, torch and NCCL versions
  eager-*    the 1B flavor in bf16 on one GPU, activation checkpointing none / selective / full: tokens/s, MFU
             against the device's dense bf16 peak, peak CUDA memory against the dry run's total (state +
             activations + the loss's gradient), launched with run_train.sh
  moe        expert kernels (torch._grouped_mm against the per-expert loop, bf16, forward + backward) and the
             debug MoE model trained both ways: losses per step and step times
  ckpt       async checkpoint through pinned host buffers and exact resume (losses bit for bit), a profiler trace
             and a CUDA memory snapshot written and read back, and staging time pinned against unpinned
  nccl2      whether NCCL lets two processes share the one GPU (the two-rank pipeline needs it)
  tests      the unit and single-process integration tests with TRAINER_TEST_DEVICE=cuda
  compile-*  the 1B flavor with [compile] on, activation checkpointing none / full / selective
  causal-none  eager, no recomputation, plain causal attention (no document mask: the flash kernel)
Results: DIR/summary.json after every step, DIR/logs.tar.gz (every step's log, the trace and the snapshot), and a
table on stdout at the end. Prepared token shards and a tokenizer file are read from --data and --tokenizer, for a
GPU machine without network or the datasets package; made beforehand on any machine with:

  mkdir -p gpu && python -c "import shutil, trainer.data.tokenizer as t; shutil.copy(t.default_tokenizer_path(), 'gpu')"
  T="--model.tokenizer_path gpu/cl100k_base.tiktoken"
  python -m trainer.prepare gpu/data/debug --job.config_file configs/debug_model.toml $T
  python -m trainer.prepare gpu/data/full --job.config_file configs/debug_model.toml --model.flavor 1B $T
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> (time cap in seconds, least time left to start it)
STEPS = {
    "env": (30, 5),
    "eager-none": (90, 40),
    "eager-selective": (90, 40),
    "eager-full": (90, 40),
    "moe": (90, 30),
    "ckpt": (90, 30),
    "nccl2": (45, 15),
    "tests": (170, 60),
    "compile-none": (150, 60),
    "causal-none": (90, 40),
    "compile-full": (150, 60),
    "compile-selective": (150, 60),
}
STEP_LINE = re.compile(r"step\s+(\d+)/\d+\s+loss\s+(\S+)\s.*?tok/s\s+([\d,]+).*?"
                       r"step_time ([\d.]+)s.*?(?:gpu|rss)_peak ([\d.]+)GiB")
MFU = re.compile(r"mfu\s+([\d.]+)%")


def common(args) -> list[str]:
    """Data and tokenizer overrides shared by every run."""
    return ["--model.tokenizer_path", args.tokenizer, "--validation.no-enable", "--metrics.log_freq", "1"]


def big_model(args) -> list[str]:
    if args.smoke:
        return ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.local_batch_size", "2",
                "--training.dataset_path", f"{args.data}/debug", "--training.steps", "5"]
    return ["--model.flavor", "1B", "--training.seq_len", "2048", "--training.local_batch_size", "4",
            "--training.dataset_path", f"{args.data}/full", "--training.steps", "12"]


def parse_steps(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if (m := STEP_LINE.search(line)) is None:
            continue
        mfu = MFU.search(line)
        rows.append({"step": int(m[1]), "loss": float(m[2]), "tok_s": float(m[3].replace(",", "")),
                     "mfu": float(mfu[1]) if mfu else None, "step_time": float(m[4]), "peak_gib": float(m[5])})
    return rows


def estimate(overrides: list[str]) -> dict:
    """The plan's memory estimate for this job on an accelerator (GiB): fp32 state, saved activations, and the
    loss's gradient at the start of backward (the dry run's total is their sum)."""
    from trainer.config import load_config
    from trainer.plan import build_job_plan

    plan = build_job_plan(load_config("configs/debug_model.toml", overrides), 1, check_memory=False)
    act = plan.activation_peaks("cuda")
    return {"state_gib": plan.state_gib_per_device(0),
            "activations_gib": None if isinstance(act, str) else act[0] / 2**30,
            "loss_gradient_gib": plan.loss_gradient_bytes() / 2**30}


def step_train(args, name: str, work: Path) -> dict:
    """One run of the big model through run_train.sh; step figures from its log."""
    kind, ac = name.split("-")  # eager, compile or causal; the activation checkpointing mode
    overrides = common(args) + big_model(args) + ["--activation_checkpoint.mode", ac,
                                                  "--job.dump_folder", str(work / name)]
    if kind == "compile":
        overrides.append("--compile.enable")
    if kind == "causal":
        overrides += ["--model.attn_mask_type", "causal"]
    if name == "eager-none":  # what autograd keeps, measured at one step, beside the estimate (in the log)
        overrides += ["--profiling.activation_memory_steps", "3"]
    est = estimate(overrides)
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "1"}
    start = time.monotonic()
    proc = subprocess.run(["bash", "run_train.sh", *overrides], cwd=REPO, env=env, capture_output=True, text=True)
    print(proc.stdout + proc.stderr)
    rows = parse_steps(proc.stdout + proc.stderr)
    out = {"rc": proc.returncode, "wall_s": time.monotonic() - start, **est, "steps": rows}
    timed = rows[3:] or rows  # the first steps hold compilation and allocator warm-up
    if timed:
        out.update(median_step_s=statistics.median(r["step_time"] for r in timed),
                   median_tok_s=statistics.median(r["tok_s"] for r in timed),
                   median_mfu=statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
                   peak_gib=max(r["peak_gib"] for r in rows), first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"])
        if est["activations_gib"] is not None:
            out["estimate_gib"] = est["state_gib"] + est["activations_gib"] + est["loss_gradient_gib"]
            out["measured_over_estimate"] = out["peak_gib"] / out["estimate_gib"]
    return out


class Lines:
    """Collects the trainer's log lines of an in-process run."""

    def __init__(self):
        import logging

        self.text = []
        handler = logging.Handler()
        handler.emit = lambda record: self.text.append(record.getMessage())
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)

    def joined(self) -> str:
        return "\n".join(self.text)


def train_in_process(overrides: list[str], config: str):
    from trainer.config import load_config
    from trainer.train import main

    return main(load_config(config, overrides))


def step_moe(args, work: Path) -> dict:
    import torch

    from benchmarks.bench_moe import time_experts
    from trainer.models.moe.model import grouped_swiglu, looped_swiglu

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(8, 256, 128, 4096), (64, 256, 128, 4096), (128, 1024, 384, 8192), (64, 2048, 1408, 16384)]
    kernels = []
    for n_experts, dim, hidden, tokens in shapes[:2] if args.smoke else shapes:
        row = {"experts": n_experts, "dim": dim, "hidden": hidden, "tokens": tokens}
        for label, kernel in (("loop_ms", looped_swiglu), ("grouped_ms", grouped_swiglu)):
            try:
                row[label] = 1e3 * time_experts(kernel, tokens, dim, hidden, n_experts, 9, device, dtype)
            except RuntimeError as e:
                row[label] = f"error: {str(e).splitlines()[0][:120]}"
        kernels.append(row)
        print(row, flush=True)
    lines = Lines()
    runs = {}
    for grouped in (True, False):
        before = len(lines.text)
        overrides = common(args) + ["--training.dataset_path", f"{args.data}/debug", "--training.steps", "20",
                                    "--debug.deterministic", "--model.overrides.use_grouped_mm", str(grouped).lower(),
                                    "--metrics.no-enable_tensorboard",
                                    "--job.dump_folder", str(work / f"moe-{grouped}")]
        result = train_in_process(overrides, "configs/debug_moe.toml")
        steps = parse_steps("\n".join(lines.text[before:]))
        runs["grouped" if grouped else "loop"] = {
            "losses": result.losses, "median_step_s": statistics.median(r["step_time"] for r in steps[3:])}
    a, b = runs["grouped"]["losses"], runs["loop"]["losses"]
    runs["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    return {"kernels": kernels, "train": runs, "device": str(device), "dtype": str(dtype)}


def step_ckpt(args, work: Path) -> dict:
    import pickle

    import torch

    lines = Lines()
    base = common(args) + ["--training.dataset_path", f"{args.data}/debug", "--training.steps", "8",
                           "--debug.deterministic", "--metrics.no-enable_tensorboard"]
    profiled = ["--profiling.enable_profiling", "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "4"]
    straight = train_in_process(base + profiled + ["--job.dump_folder", str(work / "straight")],
                                "configs/debug_model.toml")
    ck = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_with_pinned_mem",
          "--job.dump_folder", str(work / "resumed")]
    first = train_in_process(base + ck + ["--training.stop_at_step", "4"], "configs/debug_model.toml")
    second = train_in_process(base + ck, "configs/debug_model.toml")
    log = lines.joined()
    out = {"first_equal": first.losses == straight.losses[:4], "resumed_equal": second.losses == straight.losses[4:],
           "resumed_grad_norms_equal": second.grad_norms == straight.grad_norms[4:],
           "losses": straight.losses, "pinned_logged": "through pinned host buffers" in log,
           "saves": re.findall(r"checkpoint saved: \S+ \(([\d.]+) s\)", log)}
    traces = sorted((work / "straight").rglob("*.json"))
    traces = [t for t in traces if "trace" in str(t) or "profile" in str(t)]
    if traces:
        events = json.loads(traces[0].read_text()).get("traceEvents", [])
        out["trace"] = {"file": str(traces[0].relative_to(work)), "bytes": traces[0].stat().st_size,
                        "events": len(events), "kernel_events": sum(e.get("cat") == "kernel" for e in events)}
    snaps = sorted((work / "straight").rglob("*memory_snapshot.pickle"))
    if snaps:
        snap = pickle.loads(snaps[0].read_bytes())
        out["snapshot"] = {"file": str(snaps[0].relative_to(work)), "bytes": snaps[0].stat().st_size,
                           "segments": len(snap.get("segments", [])),
                           "trace_entries": sum(len(t) for t in snap.get("device_traces", []))}
    if torch.cuda.is_available():  # staging 1 GiB of CUDA tensors: what a step waits for in an async save
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from trainer.checkpoint.torch_dcp import pinned_stager, stager_keeps_buffers

        state = {f"t{i}": torch.randn(16 << 20, device="cuda") for i in range(16)}
        out["stager_keeps_buffers"] = stager_keeps_buffers()
        for label, make in (("unpinned", lambda: DefaultStager(StagingOptions(False, False, False, False))),
                            ("pinned", pinned_stager)):
            times, stager = [], None
            for _ in range(3):  # as the checkpointer does: one stager for every save where torch allows it
                if stager is None or not stager_keeps_buffers():
                    stager = make()
                torch.cuda.synchronize()
                start = time.perf_counter()
                stager.stage(state)
                times.append(time.perf_counter() - start)
            stager.close()
            out[f"stage_1gib_{label}_s"] = times
    return out


NCCL2 = """
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda:0") * (dist.get_rank() + 1)
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", dist.get_rank(), "all_reduce", t.tolist(), flush=True)
dist.destroy_process_group()
"""


def step_nccl2(args, work: Path) -> dict:
    script = work / "nccl2.py"
    script.write_text(NCCL2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--log-dir", str(work / "torchrun"), str(script)],
                          capture_output=True, text=True, timeout=40)
    text = proc.stdout + proc.stderr
    print(text)
    errors = [line for line in text.splitlines() if re.search(r"\w+(Error|Exception): |NCCL (WARN|error)", line)]
    return {"rc": proc.returncode, "ok": proc.returncode == 0 and "all_reduce [3.0" in text,
            "errors": [line[:300] for line in errors[:6]]}


def step_tests(args, work: Path) -> dict:
    env = {**os.environ, "TRAINER_TEST_DEVICE": "cuda" if not args.smoke else "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", "-rfEs",
           "tests/unit", "tests/integration"]
    if args.smoke:
        cmd = cmd[:-2] + ["tests/unit/test_cuda.py", "tests/unit/test_moe.py"]
    for plugin, extra in (("xdist", ["-n", "6"]), ("pytest_timeout", ["--timeout", "90"])):
        try:
            __import__(plugin)
            cmd += extra
        except ImportError:
            pass
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    print(proc.stdout[-200000:] + proc.stderr[-20000:])
    summary = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"rc": proc.returncode, "summary": summary[-1] if summary else "", "failed": failed[:80]}


def step_env(args, work: Path) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(0), memory_gib=torch.cuda.get_device_properties(0).total_memory
                   / 2**30, nccl=".".join(map(str, torch.cuda.nccl.version())))
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True)
        out["nvidia_smi"] = smi.stdout.strip()
    return out


def run_step(args, name: str, work: Path) -> dict:
    if name == "env":
        return step_env(args, work)
    if name.startswith(("eager-", "compile-", "causal-")):
        return step_train(args, name, work)
    return globals()[f"step_{name}"](args, work)


def orchestrate(args) -> None:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    summary = {}
    for name, (cap, least) in STEPS.items():
        if args.steps and name not in args.steps:
            continue
        left = deadline - time.monotonic()
        if left < least:
            summary[name] = {"skipped": f"{left:.0f} s left of the budget, {least} s needed"}
            continue
        log = work / "logs" / f"{name}.log"
        start = time.monotonic()
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, __file__, "--step", name, "--work", str(work / name),
                                     "--data", args.data, "--tokenizer", args.tokenizer] + (["--smoke"] if args.smoke
                                                                                              else []),
                                    cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=min(cap, left))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        result_file = work / name / "result.json"
        summary[name] = json.loads(result_file.read_text()) if result_file.is_file() else {
            "failed": f"exit {proc.returncode}", "log_tail": log.read_text()[-3000:]}
        summary[name]["seconds"] = round(time.monotonic() - start, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"{name}: {summary[name]['seconds']} s, {str(summary[name])[:300]}", flush=True)
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:  # rewritten after each step: survives a kill
            tar.add(work / "logs", arcname="logs")
            for extra in list(work.rglob("*memory_snapshot.pickle")) + list(work.rglob("*trace*.json")):
                if extra.stat().st_size < 8 << 20:
                    tar.add(extra, arcname=f"files/{extra.relative_to(work)}")
    report(summary)


def report(summary: dict) -> None:
    print("\n| run | median step (s) | tokens/s | MFU % | peak GiB | estimate GiB | peak / estimate"
          " | loss first -> last |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in summary.items():
        if "median_step_s" in r:
            print(f"| {name} | {r['median_step_s']:.3f} | {r['median_tok_s']:.0f} | {r['median_mfu']} | "
                  f"{r['peak_gib']:.2f} | {r.get('estimate_gib', 0):.2f} | {r.get('measured_over_estimate', 0):.3f} |"
                  f" {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
        elif name.startswith(("eager", "compile", "causal")):
            print(f"| {name} | {str(r)[:200]} |")
    for name in ("moe", "ckpt", "nccl2", "tests"):
        if name in summary:
            print(f"\n{name}: {json.dumps(summary[name])[:1500]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--work", default="/tmp/bench_gpu")
    parser.add_argument("--budget", type=float, default=480, help="seconds for all steps together")
    parser.add_argument("--data", default="gpu/data", help="folder with prepared shards debug/ and full/")
    parser.add_argument("--tokenizer", default="gpu/cl100k_base.tiktoken")
    parser.add_argument("--steps", nargs="*", choices=list(STEPS), help="only these steps")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU: check the script")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.data, args.tokenizer = str(Path(args.data).resolve()), str(Path(args.tokenizer).resolve())
    if args.step:
        os.chdir(REPO)
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        result = run_step(args, args.step, work)
        (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
        return
    orchestrate(args)


if __name__ == "__main__":
    main()
