"""A timed pipeline run checks the plan's prediction and calibrates the next one.

For each step of ``[profiling] pipeline_timeline_steps`` the reporting rank hands the measured
actions here: it logs measured against predicted time per pipeline rank and action kind (the
prediction scaled to the measured total when the plan is in relative units), the bubble per rank
measured, predicted before calibration and predicted after it, then fits seconds per action kind
to every step recorded so far (``pipeline_cost.fit_costs``), writes them to
``<save_traces_folder>/pipeline_costs.json`` and says which split the planner would choose with
them and what it would gain. ``--parallelism.pipeline_parallel_cost_file`` reads that file back.
"""

import math
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from trainer.parallel.pipeline_cost import KINDS, PartCosts, calibrated_costs, fit_costs, write_cost_file
from trainer.parallel.pipeline_planner import Prediction, Simulator, search_splits
from trainer.parallel.schedule_sim import Program


class Calibration:
    def __init__(self, *, units: PartCosts, plan_costs: PartCosts, counts: tuple[int, ...], program: Program,
                 path: Path, identity: dict, measured: dict, layers_attr: str):
        """``units``: the FLOP model in relative units (what measurements are fitted against); ``plan_costs``:
        what the plan predicted with;
        ``measured``: what the file records about the run (schedule, pp, split points, device)."""
        self.units, self.plan_costs, self.counts, self.program = units, plan_costs, tuple(counts), program
        self.path, self.identity, self.meta = Path(path), identity, measured
        self.layers_attr = layers_attr
        self.actions: list[tuple[str, int, float]] = []
        self.parts: list[tuple[str, int, str, float]] = []
        self.steps: list[int] = []
        self.spans: list[float] = []
        self.owner = program.owner()

    def add(self, step: int, actions: list[tuple[str, int, float]], measured_bubble: dict[int, float],
            span: float, parts: list[tuple[str, int, str, float]] = ()) -> str:
        """Record one step's (kind, stage, seconds) actions, its pipeline span (seconds) and the (kind, stage,
        "lead" or "tail", seconds) times its actions spent before and after their blocks; returns the log text."""
        self.actions += actions
        self.parts += parts
        self.steps.append(step)
        self.spans.append(span)
        ranks = range(self.program.num_ranks)
        measured = {(r, k): 0.0 for r in ranks for k in KINDS}
        for kind, stage, seconds in actions:
            measured[(self.owner[stage], kind)] += seconds
        spans: list = []
        before = Simulator(self.plan_costs, self.program).predict(self.counts, spans)
        predicted = {(r, k): 0.0 for r in ranks for k in KINDS}
        for r, kind, _, _, start, end in spans:
            predicted[(r, kind)] += end - start
        scale = 1.0
        if self.plan_costs.unit != "s":  # relative units: compare shares of the measured total
            scale = sum(measured.values()) / max(sum(predicted.values()), 1e-30)
        per_rank = "; ".join(
            f"pp rank {r} " + ", ".join(f"{k} {1e3 * measured[(r, k)]:.1f} ms"
                                        f" (predicted {1e3 * scale * predicted[(r, k)]:.1f})"
                                        for k in KINDS if measured[(r, k)] or predicted[(r, k)])
            for r in ranks)
        fit = fit_costs(self.units, list(self.counts), self.actions, self.parts)
        costs = calibrated_costs(self.units, fit, send=0.0, source=f"measured steps {self.steps}")
        send = fit_transfer(costs, self.program, self.counts, statistics.median(self.spans))
        sim = Simulator(replace(costs, send=send), self.program)
        after = sim.predict(self.counts)
        best = search_splits(sim).best[0]
        write_cost_file(self.path, identity=self.identity, fit=fit,
                        measured=self.meta | {"steps": self.steps, "counts": list(self.counts), "transfer_s": send,
                                              "span_s": statistics.median(self.spans)})
        gain = 1 - best.makespan / after.makespan
        choice = ("the planner keeps this split with the measured costs" if best.counts == self.counts else
                  f"with the measured costs the planner would choose {self._points(best)}: predicted step"
                  f" {1e3 * best.makespan:.1f} ms against {1e3 * after.makespan:.1f} ms for this split"
                  f" ({100 * gain:.1f}% shorter)")
        last = str(len(self.counts) - 1)

        def timed_parts(f: dict) -> str:
            """The per-action cost and the own parts whose stage was timed (not those the fit inferred)."""
            out = [f"{1e3 * f['overhead_s']:.2f} ms per action"]
            if "0" in f["part_mean_s"].get("lead", {}):
                out.append(f"first stage's own part {1e3 * f['pre_s']:.2f} ms")
            if last in f["part_mean_s"].get("tail", {}):
                out.append(f"last stage's own part {1e3 * f['post_s']:.2f} ms")
            return ", ".join(out)

        timed = "; ".join(f"{k} {timed_parts(f)}" for k, f in fit.items() if "part_mean_s" in f)
        per_rank += (f" (outside the blocks, timed at their boundaries: {timed}, per microbatch)" if timed else
                     " (the parts outside the blocks not timed: each stage divided as the FLOP model does)")
        if per_block := self._per_block():
            per_rank += f"; a block took {per_block} (the costs price every rank's blocks alike)"
        return (f"pipeline costs of step {step}: {per_rank}. Bubble per pp rank measured "
                f"{_bubbles(measured_bubble)}, predicted {_bubbles(_of(before))} before calibration,"
                f" {_bubbles(_of(after))} after (a transfer between ranks fitted at {1e3 * send:.2f} ms);"
                f" {choice}; measured costs written to {self.path}")

    def _block_means(self) -> dict[tuple[str, int], float]:
        """(kind, pipeline rank) -> mean seconds per block and microbatch over the recorded steps (the first stage's
        split backward, its W, counts as B). A block counts as its share of the mean block's price in the FLOP
        model (``units``), so ranks that hold cheaper or dearer blocks compare at one pace: counted one each, a rank
        of light blocks reads as a fast one."""
        starts = [1 + sum(self.counts[:s]) for s in range(len(self.counts))]
        total: dict[tuple[str, int], list[float]] = {}
        for kind, stage, part, seconds in self.parts:
            if part == "blocks" and self.counts[stage]:
                named = "B" if (kind, stage) == ("W", 0) else kind
                acc = total.setdefault((named, self.owner[stage]), [0.0, 0.0])
                acc[0] += seconds
                acc[1] += self._blocks_priced(kind, stage, starts[stage])
        return {key: t / n for key, (t, n) in total.items() if n > 0}  # blocks priced at nothing: no figure

    def _blocks_priced(self, kind: str, stage: int, start: int) -> float:
        """How many mean blocks ``stage``'s blocks are worth in a ``kind`` action by the FLOP model (the first
        stage's W is its whole backward, priced as B); their count where the model prices blocks at nothing."""
        priced = "B" if (kind, stage) == ("W", 0) else kind
        values = self.units.parts[priced]
        mean = math.fsum(values[1:-1]) / (len(values) - 2)
        count = self.counts[stage]
        return math.fsum(values[start:start + count]) / mean if mean > 0 else float(count)

    def _per_block(self) -> str:
        """Each pipeline rank's mean seconds per block (of the mean block's price) and microbatch by action kind,
        over the recorded steps (``_block_means``)."""
        means = self._block_means()
        ranks = range(self.program.num_ranks)
        kinds = [f"{k} " + " / ".join(f"{1e3 * means[(k, r)]:.2f}" for r in ranks) + " ms"
                 for k in KINDS if all((k, r) in means for r in ranks)]
        return f"{', '.join(kinds)} on pp rank {' / '.join(map(str, ranks))}" if kinds else ""

    def _points(self, p: Prediction) -> str:
        starts = [sum(p.counts[:i]) for i in range(1, len(p.counts))]
        return "[" + ", ".join(f"{self.layers_attr}.{s}" for s in starts) + "]"


def fit_transfer(costs: PartCosts, program: Program, counts: tuple[int, ...], span: float) -> float:
    """The time of one transfer between ranks that makes the simulated step as long as the measured span:
    what the measured step has beyond its compute in the schedule's order (0 when it has nothing)."""
    return transfer_for_span(lambda send: Simulator(replace(costs, send=send), program).predict(counts).makespan,
                             span)


def transfer_for_span(makespan: Callable[[float], float], span: float) -> float:
    """The transfer time at which ``makespan(send)`` (growing with it) reaches ``span``; 0 when it is reached
    with none."""
    if makespan(0.0) >= span:
        return 0.0
    low, high = 0.0, span
    for _ in range(40):  # the step grows with the transfer time: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < span else (low, mid)
    return (low + high) / 2


def _of(p: Prediction) -> dict[int, float]:
    return {r: p.bubble(r) for r in range(len(p.busy))}


def _bubbles(b: dict[int, float]) -> str:
    return "/".join(f"{100 * b[r]:.1f}%" for r in sorted(b))
