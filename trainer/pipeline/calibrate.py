"""A timed pipeline run checks the plan's prediction and calibrates the next one (docs/pipeline.md, "Measured
costs: calibration from a timed run")."""

import math
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from trainer.pipeline.cost import PartCosts, calibrated_costs, write_cost_file
from trainer.pipeline.search import Prediction, Simulator, search_splits
from trainer.pipeline.simulate import KINDS, Program


class Calibration:
    def __init__(self, *, units: PartCosts, plan_costs: PartCosts, counts: tuple[int, ...], program: Program,
                 path: Path, identity: dict, measured: dict, layers_attr: str):
        """``units``: the FLOP model in relative units (what measurements are fitted against); ``plan_costs``: what
        the plan predicted with; ``measured``: what the file records about the run (schedule, pp, split points)."""
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

        def timed_parts(f: dict) -> str:  # the per-action cost and the own parts whose stage was timed
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
                f"{_bubbles(measured_bubble)}, predicted {_bubbles(before)} before calibration,"
                f" {_bubbles(after)} after (a transfer between ranks fitted at {1e3 * send:.2f} ms);"
                f" {choice}; measured costs written to {self.path}")

    def _per_block(self) -> str:
        """Each pipeline rank's mean seconds per block and microbatch by action kind, over the recorded steps (the
        first stage's split backward, its W, counts as B). A block counts as its share of the mean block's price in
        the FLOP model (``units``; one each where it prices blocks at nothing), so ranks that hold cheaper or dearer
        blocks compare at one pace: counted one each, a rank of light blocks reads as a fast one."""
        starts = [1 + sum(self.counts[:s]) for s in range(len(self.counts))]
        total: dict[tuple[str, int], list[float]] = {}
        for kind, stage, part, seconds in self.parts:
            if part == "blocks" and self.counts[stage]:
                named = "B" if (kind, stage) == ("W", 0) else kind
                values, count = self.units.parts[named], self.counts[stage]
                mean = math.fsum(values[1:-1]) / (len(values) - 2)
                acc = total.setdefault((named, self.owner[stage]), [0.0, 0.0])
                acc[0] += seconds
                acc[1] += math.fsum(values[starts[stage]:starts[stage] + count]) / mean if mean > 0 else float(count)
        means = {key: t / n for key, (t, n) in total.items() if n > 0}  # blocks priced at nothing: no figure
        ranks = range(self.program.num_ranks)
        kinds = [f"{k} " + " / ".join(f"{1e3 * means[(k, r)]:.2f}" for r in ranks) + " ms"
                 for k in KINDS if all((k, r) in means for r in ranks)]
        return f"{', '.join(kinds)} on pp rank {' / '.join(map(str, ranks))}" if kinds else ""

    def _points(self, p: Prediction) -> str:
        starts = [sum(p.counts[:i]) for i in range(1, len(p.counts))]
        return "[" + ", ".join(f"{self.layers_attr}.{s}" for s in starts) + "]"


def fit_costs(model_costs: PartCosts, counts: list[int], actions: list[tuple[str, int, float]],
              parts: list[tuple[str, int, str, float]] = ()) -> dict:
    """Seconds per action kind fitted to measured actions (kind, stage, seconds) of a run split into stages of
    ``counts`` blocks (docs/pipeline.md, "Measured costs: calibration from a timed run"): a stage's duration = lead
    overhead + tail overhead + per_unit x (the FLOP model's units of its blocks) + pre (first stage) + post (last
    stage). ``parts`` (kind, stage, "lead" or "tail", seconds) pin the overheads, pre and post directly."""
    def fitted_kind(kind: str, stage: int) -> str | None:
        """The first stage's split backward: its W is its whole backward (B), its I computes nothing."""
        return {"I": None, "W": "B"}.get(kind, kind) if stage == 0 else kind

    samples: dict[tuple[str, int], list[float]] = {}
    for kind, stage, seconds in actions:
        if (fitted := fitted_kind(kind, stage)) is not None:
            samples.setdefault((fitted, stage), []).append(seconds)
    own: dict[tuple[str, str, int], list[float]] = {}
    for kind, stage, part, seconds in parts:
        if (fitted := fitted_kind(kind, stage)) is not None:
            own.setdefault((fitted, part, stage), []).append(seconds)
    fit = {}
    last = len(counts) - 1
    starts = [1 + sum(counts[:s]) for s in range(len(counts))]
    # unknowns: lead overhead, tail overhead, seconds per block unit, pre, post
    for kind in ("F", "I", "W", "B"):  # B last: a split backward measures it on the first stage alone
        stages = sorted(s for k, s in samples if k == kind)
        if not stages:
            continue
        units = model_costs.parts[kind]
        y = [statistics.fmean(samples[(kind, s)]) for s in stages]
        rows = [[1.0, 1.0, math.fsum(units[starts[s]:starts[s] + counts[s]]), float(s == 0), float(s == last)]
                for s in stages]
        modelled = [r[2] + units[0] * r[3] + units[-1] * r[4] for r in rows]
        sigma = sum(y) / sum(modelled)  # seconds per unit, over the whole measured step
        prior = [0.0, 0.0, sigma, sigma * units[0], sigma * units[-1]]
        if kind == "B" and "I" in fit and "W" in fit and 0 in stages:
            # A fused backward does what the input and weight gradients do, in one pass: their fitted sum
            # is what the measurements leave open. What the fused ones measured beyond it is the
            # embedding's gradient (the first stage's part no I or W measured); short of it, the fused
            # pass saves that share of the work.
            block_units = {k: math.fsum(model_costs.parts[k][1:-1]) for k in "IWB"}
            i, w = fit["I"], fit["W"]
            both = [i["lead_overhead_s"] + w["lead_overhead_s"], i["tail_overhead_s"] + w["tail_overhead_s"],
                    (i["per_unit_s"] * block_units["I"] + w["per_unit_s"] * block_units["W"]) / block_units["B"],
                    i["pre_s"] + w["pre_s"], i["post_s"] + w["post_s"]]
            predicted = [math.fsum(v * x for v, x in zip(both, r, strict=True)) for r in rows]
            first = stages.index(0)
            both[3] += max(y[first] - predicted[first], 0.0)
            predicted[first] = max(y[first], predicted[first])
            prior = [v * sum(y) / sum(predicted) for v in both]
        # Each prior row weighs like 1/100 of a stage measurement of a block's size: it settles only what
        # the measurements leave open.
        size = [sigma, sigma, sigma, sigma * max(units[0], 1.0), sigma * max(units[-1], 1.0)]
        a = [[v / sigma for v in r] for r in rows] + [[0.01 * sigma / size[j] * (i == j) for i in range(5)]
                                                       for j in range(5)]
        b = [v / sigma for v in y] + [0.01 * sigma / size[j] * prior[j] for j in range(5)]
        timed: dict[str, dict[str, float]] = {}
        # A timed lead or tail weighs like ten stage measurements: it measures its unknowns directly, while a
        # stage's duration also holds its blocks, whose pace differs between ranks in ways the costs do not
        # model (a rank that waits much runs its blocks slower on a shared CPU): that difference goes to
        # the price of a block, not into the parts around it.
        for part, overhead, own_part, own_stage in (("lead", 0, 3, 0), ("tail", 1, 4, last)):
            for s in stages:
                if own.get((kind, part, s)):
                    mean = timed.setdefault(part, {})[str(s)] = statistics.fmean(own[(kind, part, s)])
                    a.append([10.0 * (j == overhead or (j == own_part and s == own_stage)) / sigma for j in range(5)])
                    b.append(10.0 * mean / sigma)
        lead, tail, per_unit, pre, post = _nonnegative_lstsq(a, b)
        fit[kind] = {"overhead_s": lead + tail, "lead_overhead_s": lead, "tail_overhead_s": tail,
                     "per_unit_s": per_unit, "pre_s": pre, "post_s": post,
                     "stage_mean_s": dict(zip(map(str, stages), y, strict=True))}
        if timed:
            fit[kind]["part_mean_s"] = timed
    return fit


def _nonnegative_lstsq(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares with every unknown >= 0: an unknown that comes out negative is fixed at 0 and the
    rest solved again (a duration has no negative part)."""
    free = list(range(len(a[0])))
    while True:
        cols = torch.tensor([[row[j] for j in free] for row in a], dtype=torch.float64)
        x = torch.linalg.lstsq(cols, torch.tensor(b, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1).tolist()
        negative = [j for j, v in zip(free, x, strict=True) if v < 0]
        if not negative:
            out = [0.0] * len(a[0])
            for j, v in zip(free, x, strict=True):
                out[j] = v + 0.0  # no -0.0
            return out
        free = [j for j in free if j not in negative]


def fit_transfer(costs: PartCosts, program: Program, counts: tuple[int, ...], span: float) -> float:
    """The time of one transfer between ranks that makes the simulated step as long as the measured span:
    what the measured step has beyond its compute in the schedule's order (0 when it has nothing)."""
    def makespan(send: float) -> float:
        return Simulator(replace(costs, send=send), program).predict(counts).makespan

    if makespan(0.0) >= span:
        return 0.0
    low, high = 0.0, span
    for _ in range(40):  # the step grows with the transfer time: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < span else (low, mid)
    return (low + high) / 2


def _bubbles(b: "dict[int, float] | Prediction") -> str:
    b = {r: b.bubble(r) for r in range(len(b.busy))} if isinstance(b, Prediction) else b
    return "/".join(f"{100 * b[r]:.1f}%" for r in sorted(b))
