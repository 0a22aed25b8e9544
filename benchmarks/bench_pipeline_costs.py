"""The FLOP model against each part timed on one device, and what the difference does to the pipeline plan.

    python benchmarks/bench_pipeline_costs.py [--models debug,12x32k] [--device cuda] [--steps 20] [--out DIR]

For each model, ``trainer.measure_costs`` times every part (embedding, each block, output and loss; F, B, I,
W) on the device, one process, and writes a cost file. Reported:
- per part and kind, the measured milliseconds and the part's cost in blocks, measured and by the FLOP model
  (how many of the mean block's forward the part costs: the output projection of a large vocabulary is the
  part the FLOP model prices least well where kernels are launch- or memory-bound);
- per schedule and pipeline degree, the split the planner chooses with the FLOP model and with the measured
  costs, the predicted step of the FLOP model's split under the measured costs against the measured costs'
  own choice (what planning without a measurement loses), and each rank's predicted bubble for the FLOP
  model's split by both cost tables (points apart: the FLOP model's error where only compute matters).
Transfers between ranks and the per-action cost of the schedule are not in a one-device measurement; both
plans price transfers with the same link settings. Figures: docs/performance.md.

``--memory-gbps N`` (or ``copy``: the bandwidth of one large tensor copy on the device, read and write
counted) adds a third figure to each part: the FLOP model with the loss's and the embedding gradient's bytes
priced at that bandwidth (``pipeline_parallel_device_memory_gbytes_per_second``), beside a throughput
taken from the measured mean block's forward (its FLOPs over its time), so that it reads in blocks too.
A one-device measurement clears the gradients after every microbatch: its embedding gradient is written
once, where the model counts the four passes of a gradient accumulated over a step's microbatches.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEBUG = ["--job.config_file", str(REPO / "configs/debug_model.toml")]
MODELS = {
    "debug": DEBUG,
    "12x32k": DEBUG + ["--model.overrides.n_layers", "12", "--model.overrides.vocab_size", "32768"],
    "1B": DEBUG + ["--model.flavor", "1B", "--training.seq_len", "2048"],
    "8B": DEBUG + ["--model.flavor", "8B", "--training.seq_len", "2048"],
    "1B-fullAC": DEBUG + ["--model.flavor", "1B", "--training.seq_len", "2048", "--activation_checkpoint.mode", "full"],
}
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def part_table(name: str, parts: dict, units, moved: dict | None = None, bytes_per_second: float = 0.0) -> list[str]:
    """Measured ms per part and kind, and each part in blocks (the mean block's forward), measured / FLOP model
    (/ FLOP model with ``moved`` bytes (``pipeline_cost.memory_bytes``) at ``bytes_per_second``)."""
    block_f = statistics.fmean(parts["F"][1:-1])
    unit_f = statistics.fmean(units.parts["F"][1:-1])
    extra: dict[tuple[str, int], float] = {}  # (kind, part index) -> blocks the bytes add
    for key, n in (moved or {}).items() if bytes_per_second else ():
        where, kind = key.split()
        for k in (kind, "B") if kind in "IW" else (kind,):  # a full backward B is I + W
            index = 0 if where == "pre" else -1
            extra[(k, index)] = extra.get((k, index), 0.0) + n / bytes_per_second / block_f
    rows = []
    for kind in ("F", "B", "I", "W"):
        v, u = parts[kind], units.parts[kind]
        cells = []
        for i, m, f in ((0, v[0], u[0]), (None, statistics.fmean(v[1:-1]), statistics.fmean(u[1:-1])),
                        (-1, v[-1], u[-1])):
            model = f" / {f / unit_f + extra.get((kind, i), 0.0):.2f}" if bytes_per_second else ""
            cells.append(f"{1e3 * m:.3f} ms ({m / block_f:.2f} / {f / unit_f:.2f}{model})")
        rows.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    return rows


def copy_bytes_per_second(device: str) -> float:
    """One 256 MB float32 copy on ``device``: bytes read and written over its median time of 5."""
    import torch

    src = torch.ones(1 << 26, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def plan_rows(name: str, base: list[str], cost_file: Path, pps: list[int]) -> list[dict]:
    from tests.conftest import load_plan
    from trainer.pipeline.search import Simulator
    from trainer.pipeline.simulate import program_for

    out = []
    for pp in pps:
        for schedule in SCHEDULES:
            args = base + ["--parallelism.pipeline_parallel_degree", str(pp),
                           "--parallelism.pipeline_parallel_schedule", schedule,
                           "--training.local_batch_size", str(4 * pp)]
            try:
                flop = load_plan(args, pp, check_memory=False)
                measured = load_plan(args + ["--parallelism.pipeline_parallel_cost_file", str(cost_file)], pp,
                                     check_memory=False)
            except Exception as e:  # a schedule this depth or block count does not allow
                out.append({"model": name, "pp": pp, "schedule": schedule, "skipped": str(e).splitlines()[0][:120]})
                continue
            p = flop.pipeline
            program = program_for(schedule, pp, flop.n_microbatches, p.stages_per_rank)
            by_flop = Simulator(flop.pipeline_costs, program)
            by_measure = Simulator(measured.pipeline_costs, program)
            f_counts, m_counts = p.counts, measured.pipeline.counts
            at_f, at_m = by_measure.predict(f_counts), by_measure.predict(m_counts)
            prior = by_flop.predict(f_counts)
            ranks = range(len(at_f.busy))
            out.append({"model": name, "pp": pp, "schedule": schedule, "flop_split": f_counts,
                        "measured_split": m_counts, "loss_pct": 100 * (at_f.makespan / at_m.makespan - 1),
                        "step_ms": 1e3 * at_m.makespan,
                        "bubble_flop": [100 * prior.bubble(r) for r in ranks],
                        "bubble_measured": [100 * at_f.bubble(r) for r in ranks]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="debug,12x32k")
    parser.add_argument("--device", default="")
    parser.add_argument("--steps", type=at_least(1), default=20)
    parser.add_argument("--pp", default="2")
    parser.add_argument("--out", default="/tmp/bench_pipeline_costs")
    parser.add_argument("--memory-gbps", default="", help="GB/s, or 'copy' (measured); adds the memory model")
    args = parser.parse_args()
    import torch

    from trainer.config import load_config
    from trainer.measure_costs import measure
    from trainer.pipeline.cost import memory_bytes
    from trainer.plan import build_job_plan
    from trainer.pipeline.cost import pipeline_costs

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bytes_per_second = (copy_bytes_per_second(device) if args.memory_gbps == "copy"
                        else float(args.memory_gbps or 0) * 1e9)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts_rows, whole_rows, plans = [], [], []
    report = {"device": device, "torch": torch.__version__, "memory_bytes_per_second": bytes_per_second, "models": {}}
    if device.startswith("cuda"):
        report["device_name"] = torch.cuda.get_device_name(device)
    for name in args.models.split(","):
        base = MODELS[name]
        config = load_config(overrides=base)
        start = time.perf_counter()
        path, lines = measure(config, device_name=device, steps=args.steps, out=str(out / f"{name}_costs.json"))
        seconds = time.perf_counter() - start
        print("\n".join(lines), flush=True)
        data = json.loads(path.read_text())
        plan = build_job_plan(config, 1, check_memory=False)
        whole = plan.build_model()
        units = pipeline_costs(config, plan.spec, plan.model_args, whole, plan.dims, device, relative=True)
        moved = memory_bytes(whole, plan.spec.layout(plan.model_args), dtype_bytes=plan.compute_dtype(
            torch.device(device)).itemsize, tokens=config.training.seq_len
            * config.parallelism.pipeline_parallel_microbatch_size, tp=1, loss_sharded=False)
        parts_rows += part_table(name, data["measured"]["parts_s"], units, moved, bytes_per_second)
        f_b = sum(data["measured"]["parts_s"]["F"]) + sum(data["measured"]["parts_s"]["B"])
        whole_rows.append(f"| {name} | {1e3 * f_b:.3f} | {1e3 * data['measured']['whole_s']:.3f}"
                          f" | {f_b / data['measured']['whole_s']:.3f} |")
        pps = [pp for pp in map(int, args.pp.split(",")) if 2 * pp <= plan.model_args.n_layers]
        rows = plan_rows(name, base, path, pps)
        plans += rows
        report["models"][name] = {"parts_s": data["measured"]["parts_s"], "measure_s": seconds, "plans": rows}
        (out / "report.json").write_text(json.dumps(report, indent=1, default=list))
        if device.startswith("cuda"):
            gc.collect()
            torch.cuda.empty_cache()
    memory = (f" / with the loss's and the embedding gradient's bytes at {bytes_per_second / 1e9:.1f} GB/s"
              f"{' (a copy measured)' if args.memory_gbps == 'copy' else ''}" if bytes_per_second else "")
    print(f"\n{report.get('device_name', device)}, torch {torch.__version__}; part costs, ms (in blocks: measured /"
          f" FLOP model{memory})")
    print("| model | kind | embedding | block (mean) | output + loss |\n|---|---|---:|---:|---:|")
    print("\n".join(parts_rows))
    print("\nThe parts' F + B against a forward and backward timed whole (no part marked), ms per microbatch:\n")
    print("| model | parts' F + B | whole | ratio |\n|---|---:|---:|---:|")
    print("\n".join(whole_rows))
    print("\n| model | pp | schedule | FLOP model's split | measured costs' split | FLOP split's predicted step"
          " over the measured split's | predicted bubble per rank, FLOP model / measured costs (FLOP split) |")
    print("|---|---:|---|---|---|---:|---|")
    for r in plans:
        if "skipped" in r:
            print(f"| {r['model']} | {r['pp']} | {r['schedule']} | skipped: {r['skipped']} | | | |")
            continue
        bubbles = ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(r["bubble_flop"], r["bubble_measured"], strict=True))
        print(f"| {r['model']} | {r['pp']} | {r['schedule']} | {'/'.join(map(str, r['flop_split']))} |"
              f" {'/'.join(map(str, r['measured_split']))} | {r['loss_pct']:+.1f}% ({r['step_ms']:.1f} ms) |"
              f" {bubbles} |")


if __name__ == "__main__":
    main()
