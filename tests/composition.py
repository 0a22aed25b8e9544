"""The composition table of docs/parallelism.md, derived from the code and the parity suite.

Each cell pairs two techniques or features. It is

- ``yes: <case>`` when a parity case of tests/distributed (a multi-rank run compared per tensor with one process)
  runs both: the case's plan is built and each feature is recognised in it, so the name is a real case that
  really composes the two;
- ``no: <refusal>`` when a job with both is refused: the two features' settings are planned together here and the
  plan's one-line error is quoted;
- ``-`` where the two cannot be combined by definition (two data-parallel forms, two schedule groups, two
  activation-checkpointing modes, ...);
- ``untested`` where neither holds: it plans, and no parity case runs it.

    python -m tests.composition     # the table, as docs/parallelism.md holds it

tests/unit/test_composition.py keeps the docs' table equal to this one.
"""

import contextlib
import io
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.config import load_config
from trainer.errors import ConfigError, UserError
from trainer.plan import JobPlan, build_job_plan, degrees_product

P = "--parallelism."


@dataclass(frozen=True)
class Feature:
    name: str
    settings: tuple[str, ...]
    """What a job sets to use it (on the tiny Llama of the parity suite, or its tiny MoE)."""
    runs: Callable[[JobPlan], bool]
    """Whether a planned job uses it."""
    group: str = ""
    """Features of one group exclude each other."""


def _pp(schedule: str) -> tuple[str, ...]:
    return (P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule", schedule,
            "--model.overrides.n_layers", "4")


def _pipeline(plan: JobPlan, kind: str) -> bool:
    p = plan.pipeline
    if p is None:
        return False
    if p.traits.from_file:
        return kind == "csv"
    if p.style == "v":
        return kind == "v"
    return kind == ("loop" if p.stages_per_rank > 1 else "single")


def _ac(plan: JobPlan, mode: str) -> bool:
    ac = plan.config.activation_checkpoint
    return ac.mode == mode if mode != "op" else (ac.mode == "selective" and ac.selective_ac_option == "op")


FEATURES = [
    Feature("FSDP", (P + "data_parallel_shard_degree", "2"),
            lambda p: p.dims.dp_shard > 1 and p.dims.dp_replicate == 1, "dp"),
    Feature("HSDP", (P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "2"),
            lambda p: p.dims.dp_shard > 1 and p.dims.dp_replicate > 1, "dp"),
    Feature("DDP", (P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1"),
            lambda p: p.dims.dp_replicate > 1 and p.dims.dp_shard == 1, "dp"),
    Feature("TP", (P + "tensor_parallel_degree", "2"),
            lambda p: p.dims.tp > 1 and p.config.parallelism.tensor_parallel_plan != "auto", "tp"),
    Feature("auto TP", (P + "tensor_parallel_degree", "2", P + "tensor_parallel_plan", "auto"),
            lambda p: p.dims.tp > 1 and p.config.parallelism.tensor_parallel_plan == "auto", "tp"),
    Feature("CP", (P + "context_parallel_degree", "2"), lambda p: p.dims.cp > 1),
    # carved from the FSDP ranks: its settings come first, so that another feature's data-parallel degrees win
    Feature("EP", (P + "data_parallel_shard_degree", "2", P + "expert_parallel_degree", "2"), lambda p: p.dims.ep > 1),
    Feature("PP 1F1B/GPipe", _pp("1F1B"), lambda p: _pipeline(p, "single"), "pp"),
    Feature("PP looped", _pp("Interleaved1F1B"), lambda p: _pipeline(p, "loop"), "pp"),
    Feature("PP V (ZBV, DualPipeV)", _pp("ZBVZeroBubble"), lambda p: _pipeline(p, "v"), "pp"),
    Feature("PP CSV", (P + "pipeline_parallel_degree", "2", P + "pipeline_parallel_schedule_csv", "{csv}",
                       "--model.overrides.n_layers", "4"), lambda p: _pipeline(p, "csv"), "pp"),
    Feature("tracer", _pp("1F1B") + (P + "pipeline_parallel_frontend", "tracer",
                                     "--training.mixed_precision_param", "float32"), lambda p: p.traced),
    Feature("AC full", ("--activation_checkpoint.mode", "full"), lambda p: _ac(p, "full"), "ac"),
    Feature("AC selective", ("--activation_checkpoint.mode", "selective"), lambda p: _ac(p, "selective")
            and p.config.activation_checkpoint.selective_ac_option != "op", "ac"),
    Feature("AC per-op", ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                          "op"), lambda p: _ac(p, "op"), "ac"),
    Feature("compile", ("--compile.enable",), lambda p: p.config.compile.enable),
    Feature("block-causal", ("--model.attn_mask_type", "block_causal"),
            lambda p: p.attn_mask_type == "block_causal" and p.config.model.attn_backend == "sdpa", "attention"),
    Feature("varlen", ("--model.attn_backend", "varlen"), lambda p: p.config.model.attn_backend == "varlen",
            "attention"),
    Feature("tied", ("--model.tie_embeddings",), lambda p: p.config.model.tie_embeddings),
    Feature("MoE", ("--model.name", "moe"), lambda p: p.spec.num_experts is not None),
]
# Settings a feature needs from another: expert parallelism exists for mixture-of-experts models only.
NEEDS = {"EP": "MoE"}


def parity_cases(folder: Path) -> dict[str, tuple[int, list[str]]]:
    """Every parity case of tests/distributed: 'file: case' -> (ranks, every argument of its run)."""
    from tests.distributed import (test_auto_tp_parity, test_moe_parity, test_pp_parity, test_spmd_parity,
                                   test_tracer_parity)
    from tests.distributed.harness import PARITY

    cases = {}
    for name, (nproc, overrides) in test_spmd_parity.LAYOUTS.items():
        cases[f"spmd: {name}"] = (nproc, PARITY + overrides)
    for name, (nproc, *_) in test_pp_parity.CASES.items():
        cases[f"pp: {name}"] = (nproc, PARITY + test_pp_parity.case_overrides(name, folder))
    for name, (_, nproc, _) in test_tracer_parity.CASES.items():
        cases[f"tracer: {name}"] = (nproc, test_tracer_parity.case_args(name, folder))
    for name in test_moe_parity.CASES:
        cases[f"moe: {name}"] = (test_moe_parity.CASES[name][0],
                                 test_moe_parity.BASE + test_moe_parity.case_overrides(name, folder))
    for family, base in test_auto_tp_parity.FAMILIES.items():
        for layout, (nproc, overrides) in test_auto_tp_parity.LAYOUTS.items():
            cases[f"auto_tp: {layout} ({family})"] = (nproc, base + overrides)
    return cases


def _plan(args: list[str], world: int | None = None) -> JobPlan:
    config = load_config(overrides=args)
    with contextlib.redirect_stderr(io.StringIO()):  # plan-time notes (an auto attention, a planner warning)
        return build_job_plan(config, world or degrees_product(config), check_memory=False)


def _settings(feature: Feature, csv: Path) -> list[str]:
    return [str(csv) if s == "{csv}" else s for s in feature.settings]


def _refusal(a: Feature, b: Feature, csv: Path) -> str | None:
    """The one-line error of a job with both (None: it plans)."""
    from tests.distributed.harness import PARITY
    from tests.distributed.test_moe_parity import BASE

    wanted = {a.name, b.name} | {NEEDS[n] for n in (a.name, b.name) if n in NEEDS}
    base = BASE if "MoE" in wanted else PARITY
    # one global batch per data-parallel replica's local batch, whatever the data-parallel degree
    args = list(base) + ["--training.global_batch_size", "-1"]
    for feature in sorted((f for f in FEATURES if f.name in wanted), key=lambda f: f.name != "EP"):
        args += _settings(feature, csv)
    try:
        _plan(args)
    except (ConfigError, UserError) as e:
        return str(e)
    return None


def composition() -> tuple[list[str], dict[tuple[str, str], str]]:
    """(feature names, {(row, column): cell}) for every pair, the diagonal included (the feature alone)."""
    logging.disable(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            from tests.distributed import test_pp_parity

            csv = test_pp_parity.write_csv(folder, 8)
            runs = {}
            for name, (nproc, args) in parity_cases(folder).items():
                plan = _plan(args, nproc)
                runs[name] = {f.name for f in FEATURES if f.runs(plan)}
            cells = {}
            for i, a in enumerate(FEATURES):
                for b in FEATURES[i:]:
                    cells[a.name, b.name] = _cell(a, b, runs, csv)
    finally:
        logging.disable(logging.NOTSET)
    return [f.name for f in FEATURES], cells


def _cell(a: Feature, b: Feature, runs: dict[str, set[str]], csv: Path) -> str:
    if a is not b and a.group and a.group == b.group:
        return "-"
    # the case with the fewest other features: the plainest proof (the first of them in the suite's order)
    proofs = [name for name, used in runs.items() if {a.name, b.name} <= used]
    proof = min(proofs, key=lambda name: len(runs[name]), default=None)
    if proof is not None:
        return f"yes: {proof}"
    refused = _refusal(a, b, csv)
    return f"no: {refused}" if refused is not None else "untested"


def markdown(names: list[str], cells: dict[tuple[str, str], str]) -> str:
    """One row per pair (a square table of 20 columns would not read): feature, with, cell."""
    lines = ["| feature | with | |", "|---|---|---|"]
    for (a, b), cell in cells.items():
        lines.append(f"| {a} | {'alone' if a == b else b} | {cell.replace('|', '/')} |")
    counts = {kind: sum(c.split(":")[0] == kind for c in cells.values()) for kind in ("yes", "no", "-", "untested")}
    lines.append("")
    lines.append(f"{len(cells)} cells: {counts['yes']} yes, {counts['no']} no, {counts['-']} not a combination,"
                 f" {counts['untested']} untested.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(*composition()), end="")
