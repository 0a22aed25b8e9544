"""The schedule-aware split search: the contiguous split whose replayed step is shortest, among those whose every
rank fits the memory limit (docs/pipeline.md, "The search")."""

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from trainer.pipeline.cost import PartCosts
from trainer.pipeline.simulate import KINDS, Program, replay

# Action-replays (actions x candidates) of the whole search when it lists every split, else of its branch and bound.
REPLAY_BUDGET = 2_000_000
# Action-replays of the descents from the seeds, by default: up to 8.2% faster splits than 200,000 in all
# (benchmarks/bench_planner_search.py; docs/pipeline.md, "The search", for the time it takes).
DESCENT_REPLAYS = 20_000_000
# Partial splits the branch and bound may visit per replay in its budget (a visit prices its children's stage loads
# from running sums, no replay).
NODES_PER_REPLAY = 100


@dataclass(frozen=True)
class Prediction:
    """One split's simulated step."""

    counts: tuple[int, ...]
    makespan: float
    busy: tuple[float, ...]
    """Compute time of each pipeline rank in the step."""

    def bubble(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan if self.makespan else 0.0


@dataclass(frozen=True)
class SplitSearch:
    best: tuple[Prediction, ...]
    """The best splits found, shortest step first (up to ``keep``)."""
    total: int
    """Contiguous splits of the blocks into the stages (each stage at least one block)."""
    evaluated: int
    exact: bool
    """Every split was replayed or ruled out: the first of ``best`` is the best there is (of those that fit)."""
    refused_for_memory: int
    """Splits evaluated and dropped because a rank would exceed the memory limit."""
    visited: int = 0
    """Partial splits the branch and bound priced (at most NODES_PER_REPLAY x the replay budget)."""


class Simulator:
    """Replays one schedule with the costs of any split of the blocks into its stages."""

    def __init__(self, costs: PartCosts, program: Program):
        self.costs, self.program = costs, program
        self.stage_ids = program.stage_ids()
        self.owner = program.owner()
        # Actions of each kind per stage: a rank's busy time is sum(count x cost).
        self.counts = [[0] * program.num_stages for _ in KINDS]
        for kind, stage, _ in program.actions:
            self.counts[KINDS.index(kind)][stage] += 1
        # Running sums of the blocks' costs per kind: a stage's load in O(kinds), for the branch and bound.
        self._sums = [list(itertools.accumulate(costs.parts[k][1:-1], initial=0.0)) for k in KINDS]
        self._first = [min(ids) for ids in self.stage_ids]

    def stage_load(self, table: list[list[float]], stage: int) -> float:
        return sum(self.counts[k][stage] * table[k][stage] for k in range(len(KINDS)))

    def _values(self, stage: int, start: int, end: int) -> list[float]:
        """``stage_table``'s column for ``stage`` holding blocks ``start`` to ``end`` - 1 (kinds in KINDS order), from
        running sums: equal to it up to rounding, without building the table."""
        parts, over, last = self.costs.parts, self.costs.overhead, self.program.num_stages - 1
        values = [over[kind] + self._sums[k][end] - self._sums[k][start] + (parts[kind][0] if stage == 0 else 0.0)
                  + (parts[kind][-1] if stage == last else 0.0) for k, kind in enumerate(KINDS)]
        if stage == 0:  # as stage_table: the first stage's whole backward runs as its W, its I computes nothing
            values[KINDS.index("W")], values[KINDS.index("I")] = values[KINDS.index("B")], 0.0
        return values

    def load_of(self, stage: int, start: int, end: int) -> float:
        """``stage_load`` of ``stage`` holding blocks ``start`` to ``end`` - 1: what the branch and bound prices a
        partial split with."""
        return sum(self.counts[k][stage] * v for k, v in enumerate(self._values(stage, start, end)))

    def bound(self, counts: tuple[int, ...]) -> float:
        """A step no split of ``counts`` can beat, without a replay: for each rank, one microbatch's forward through
        the stages below its first (no action of the rank can start before that: each needs a forward of its own
        stage, which needs the forwards below) plus the rank's busy time."""
        owner, send, f, last = self.owner, self.costs.send, KINDS.index("F"), len(counts) - 1
        loads, reach, start = [0.0] * len(self.stage_ids), [0.0], 0
        for s, c in enumerate(counts):
            values = self._values(s, start, start + c)
            loads[owner[s]] += sum(self.counts[k][s] * v for k, v in enumerate(values))
            reach.append(reach[-1] + values[f] + (send if s < last and owner[s] != owner[s + 1] else 0.0))
            start += c
        return max(reach[self._first[r]] + load for r, load in enumerate(loads))

    def predict(self, counts: tuple[int, ...], spans: list | None = None) -> Prediction:
        makespan, busy = replay(self.program, self.costs.stage_table(counts), self.costs.send, spans)
        return Prediction(tuple(counts), makespan, tuple(busy))


def search_splits(sim: Simulator, *, fits: Callable[[tuple[int, ...], list[list[int]]], bool] | None = None,
                  budget: int | None = None, keep: int = 4, seed: tuple[int, ...] | None = None,
                  enumerate_up_to: int | None = None) -> SplitSearch:
    """The ``keep`` best contiguous splits of ``sim``'s blocks into its stages by simulated makespan.

    ``fits(counts, placement)``: whether every rank of that split fits its memory (None: no limit). ``budget``:
    most splits to replay in the whole search (default: REPLAY_BUDGET action-replays to list every split or for
    the branch and bound, DESCENT_REPLAYS for the descents before it). ``seed``: a split to start from.
    ``enumerate_up_to``: list every split when there are at most this many (default: the budget)."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    explicit = budget is not None
    if budget is None:
        budget = max(64, REPLAY_BUDGET // max(len(sim.program.actions), 1))
    total = math.comb(n - 1, stages - 1)
    # A max-heap of the best by (makespan, then the sum of squared stage loads), negated: where the simulation
    # cannot tell splits apart, the most even stages win, as they are the least exposed to costs the model misses.
    kept: list[tuple[float, float, tuple[int, ...], Prediction]] = []
    seen: set[tuple[int, ...]] = set()
    state = {"evaluated": 0, "refused": 0, "visited": 0}

    def threshold() -> float:
        return -kept[0][0] if len(kept) == keep else math.inf

    def evaluate(counts: tuple[int, ...]) -> Prediction | None:
        if counts in seen:
            return None
        seen.add(counts)
        state["evaluated"] += 1
        if fits is not None and not fits(counts, sim.stage_ids):
            state["refused"] += 1
            return None
        pred = sim.predict(counts)
        if pred.makespan <= threshold() * (1 + 1e-8):
            table = sim.costs.stage_table(pred.counts)
            makespan = float(f"{pred.makespan:.9g}")  # makespans equal but for rounding count as ties
            spread = sum(sim.stage_load(table, s) ** 2 for s in range(stages))
            if len(kept) < keep or (makespan, spread) < (-kept[0][0], -kept[0][1]):
                heapq.heappush(kept, (-makespan, -spread, counts, pred))
                if len(kept) > keep:
                    heapq.heappop(kept)
        return pred

    if total <= (budget if enumerate_up_to is None else enumerate_up_to):
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *cuts, n)
            evaluate(tuple(b - a for a, b in zip(bounds, bounds[1:])))
        return _result(kept, total, state, exact=True)

    # Incumbents first (sharp pruning): the given seed, the rank-balanced split and the even one,
    # each walked downhill.
    even = tuple(n // stages + (1 if s < n % stages else 0) for s in range(stages))
    # A given budget bounds the whole search; by default the descents have their own, the branch and bound its own.
    descents = budget if explicit else max(budget, DESCENT_REPLAYS // max(len(sim.program.actions), 1))

    def skip(counts: tuple[int, ...], current: float) -> bool:
        """Whether a move's bound puts it above both the kept splits (whose step is compared rounded, within 1e-8)
        and the descent's current split: then it could neither be kept nor be the descent's next step. It counts as
        seen, as a replayed split does, so later descents and the branch and bound pass it by alike."""
        if counts in seen:
            return False
        bound = sim.bound(counts)
        if bound > threshold() * (1 + 1e-7) and bound > current * (1 + 1e-9):
            seen.add(counts)
            return True
        return False

    for start in dict.fromkeys(s for s in (seed, _rank_balanced(sim), even) if s is not None):
        _descend(start, evaluate, descents, state, skip)
    nodes = NODES_PER_REPLAY * budget
    if not explicit:
        budget += state["evaluated"]
    exact = _branch_and_bound(sim, n, stages, evaluate, threshold, budget, nodes, state)
    return _result(kept, total, state, exact=exact)


def _rank_balanced(sim: Simulator) -> tuple[int, ...]:
    """Cuts that give every rank the same work: each stage aims at its rank's share, less what the
    rank's first or last stage carries (embeddings, output), spread over the rank's stages."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    if n < stages:
        return tuple([1] * stages)
    # A block's load from a single-block stage in the middle; pre/post from the end stages' excess.
    one = sim.costs.stage_table([1] * stages)
    block = sim.stage_load(one, 1 if stages > 2 else 0)
    table = sim.costs.stage_table([1] * (stages - 1) + [n - stages + 1]) if stages > 1 else one
    extra_first = sim.stage_load(one, 0) - block
    extra_last = sim.stage_load(table, stages - 1) - block * (n - stages + 1)
    total = block * n + extra_first + extra_last
    share = total / len(sim.stage_ids)
    target = []
    for s in range(stages):
        r = sim.owner[s]
        extra = ((extra_first if 0 in sim.stage_ids[r] else 0.0)
                 + (extra_last if stages - 1 in sim.stage_ids[r] else 0.0))
        target.append(max(share - extra, 0.0) / len(sim.stage_ids[r]))
    weights = [t / block for t in target]  # blocks each stage should get
    scale = n / sum(weights) if sum(weights) else 1.0
    counts, placed, acc = [], 0, 0.0
    for s in range(stages):
        acc += weights[s] * scale
        c = max(1, round(acc) - placed)
        c = min(c, n - placed - (stages - 1 - s))
        counts.append(c)
        placed += c
    counts[-1] += n - placed
    return tuple(counts)


def _descend(counts: tuple[int, ...], evaluate, budget: int, state: dict, skip=None) -> Prediction | None:
    """Move one block from one stage to another while that shortens the step (first improvement, neighbouring
    stages first: docs/pipeline.md, "The search"); returns where it stopped. ``skip(counts, current step)``: a move
    not to replay."""
    best = evaluate(counts)
    current = counts
    stages = len(counts)
    moves = sorted(((i, j) for i in range(stages) for j in range(stages) if i != j), key=lambda m: abs(m[0] - m[1]))
    improved = True
    while improved and state["evaluated"] < budget:
        improved = False
        for i, j in moves:
            if current[i] < 2:
                continue
            c = list(current)
            c[i] -= 1
            c[j] += 1
            if skip is not None and best is not None and skip(tuple(c), best.makespan):
                continue
            pred = evaluate(tuple(c))
            if pred is not None and (best is None or pred.makespan < best.makespan):
                best, current, improved = pred, tuple(c), True
                break
            if state["evaluated"] >= budget:
                break
    return best


def _branch_and_bound(sim: Simulator, n: int, stages: int, evaluate, threshold, budget: int, nodes: int,
                      state: dict) -> bool:
    """Visit the splits whose busiest rank stays under the current threshold; whether every one was seen (not when
    the budget ran out first: ``budget`` replays in all, or ``nodes`` partial splits visited)."""
    owner = sim.owner
    finished = [True]
    loads = [0.0] * len(sim.stage_ids)
    slack = 1 + 1e-8  # as evaluate's tie window (steps rounded to 9 digits); running sums differ in the last bits

    def visit(prefix: list[int], used: int) -> None:
        bound = max(loads)
        if bound >= threshold() * slack:
            return
        if state["evaluated"] >= budget or state["visited"] >= nodes:
            finished[0] = False
            return
        state["visited"] += 1
        s = len(prefix)
        if s == stages - 1:
            counts = (*prefix, n - used)
            if max(loads[owner[s]] + sim.load_of(s, used, n), bound) < threshold() * slack:
                evaluate(counts)
            return
        room = n - used - (stages - 1 - s)
        ideal = (n - used) / (stages - s)
        for c in sorted(range(1, room + 1), key=lambda c: abs(c - ideal)):
            add = sim.load_of(s, used, used + c)  # not the last stage: no post part
            loads[owner[s]] += add
            visit([*prefix, c], used + c)
            loads[owner[s]] -= add

    visit([], 0)
    return finished[0]


def _result(kept, total: int, state: dict, *, exact: bool) -> SplitSearch:
    best = tuple(p for *_, p in sorted(kept, key=lambda k: (-k[0], -k[1], k[2])))
    return SplitSearch(best, total, state["evaluated"], exact, state["refused"], state["visited"])
