"""The planner's search at pp 4-16: the step of the split it finds, and how long it searches, per budget.

    python benchmarks/bench_planner_search.py            # prints a markdown table (docs/performance.md)

For each case the FLOP model's costs (relative units, full activation checkpointing) are planned as the dry run
plans them, then the search runs three times: with 200,000 action-replays in all (the budget before the
descents had their own), with the defaults (``search.DESCENT_REPLAYS`` for the descents from the
seeds, ``REPLAY_BUDGET`` for the branch and bound), and with both defaults five times larger. Where a search
ends exact the split found is the best there is. The search is deterministic: its split does not depend on the
machine, its seconds do. No process group and no GPU: this is the planning a dry run and every rank's start-up do.
"""

import argparse
import math
import sys
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.pipeline import search  # noqa: E402
from trainer.pipeline.simulate import program_for  # noqa: E402
from trainer.plan import build_job_plan  # noqa: E402

EARLIER_BUDGET = 200_000
CASES = [  # config, pp, schedule, local batch size (microbatches of 1)
    ("llama3_8b", 4, "ZBVZeroBubble", 8),
    ("llama3_8b", 4, "DualPipeV", 16),
    ("llama3_8b", 8, "ZBVZeroBubble", 16),
    ("llama3_8b", 8, "Interleaved1F1B", 16),
    ("llama3_70b", 8, "1F1B", 16),
    ("llama3_70b", 8, "ZBVZeroBubble", 16),
    ("llama3_70b", 8, "DualPipeV", 32),
    ("llama3_70b", 16, "ZBVZeroBubble", 32),
    ("llama3_70b", 16, "DualPipeV", 32),
    ("llama3_70b", 16, "Interleaved1F1B", 32),
]


def simulator(config: str, pp: int, schedule: str, batch: int) -> search.Simulator:
    job = load_config(f"configs/{config}.toml", [
        "--parallelism.pipeline_parallel_degree", str(pp), "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.tensor_parallel_degree", "8" if "70b" in config else "1",
        "--training.local_batch_size", str(batch), "--activation_checkpoint.mode", "full",
        "--parallelism.pipeline_parallel_split_mode", "flops"])  # the planner's own search runs below, timed
    plan = build_job_plan(job, pp * 64, check_memory=False)
    return search.Simulator(plan.pipeline_costs, program_for(
        schedule, pp, plan.n_microbatches, plan.pipeline.stages_per_rank))


def search(sim: search.Simulator, scale: int | None) -> tuple[search.SplitSearch, float]:
    """``scale`` None: EARLIER_BUDGET action-replays in all; else the defaults times ``scale``."""
    defaults = search.REPLAY_BUDGET, search.DESCENT_REPLAYS
    budget = None if scale is not None else max(64, EARLIER_BUDGET // len(sim.program.actions))
    if scale is not None:
        search.REPLAY_BUDGET, search.DESCENT_REPLAYS = (scale * d for d in defaults)
    try:
        start = time.perf_counter()
        found = search.search_splits(sim, budget=budget)
        return found, time.perf_counter() - start
    finally:
        search.REPLAY_BUDGET, search.DESCENT_REPLAYS = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=at_least(0), nargs="*", help="rows of CASES to run, from 0 (default: all)")
    args = parser.parse_args()
    if args.cases and max(args.cases) >= len(CASES):
        parser.error(f"--cases {max(args.cases)}: there are {len(CASES)} cases, 0 to {len(CASES) - 1}")
    scales = [None, 1, 5]
    names = ["200k in all (before)", "defaults", "defaults x 5"]
    print("| model | pp | schedule | microbatches | splits | "
          + " | ".join(f"{n}: step, search s" for n in names) + " | defaults against before |")
    print("|---|---:|---|---:|---:|" + "---|" * len(scales) + "---:|")
    for i, (config, pp, schedule, batch) in enumerate(CASES):
        if args.cases and i not in args.cases:
            continue
        sim = simulator(config, pp, schedule, batch)
        cells, steps = [], []
        for scale in scales:
            found, seconds = search(sim, scale)
            steps.append(found.best[0].makespan)
            cells.append(f"{found.best[0].makespan:,.1f}{' (exact)' if found.exact else ''}, {seconds:.1f} s")
        splits = math.comb(sim.costs.num_blocks - 1, sim.program.num_stages - 1)
        print(f"| {config[7:]} | {pp} | {schedule} | {batch} | {splits:,} | " + " | ".join(cells)
              + f" | {100 * (steps[1] / steps[0] - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
