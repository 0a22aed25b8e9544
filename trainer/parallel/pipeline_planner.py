"""Choose where to cut the model: the contiguous split whose simulated step is shortest.

What a pipeline step costs is decided by the ranks and the schedule's critical path, not by the
most expensive stage: with V placement a rank holds two stages, so equal stages can still leave
a rank idle a third of the time. Each candidate split is priced per stage and action kind
(``PartCosts``) and the schedule's own action lists are replayed with those costs and the
transfers between ranks (``schedule_sim.replay``); the split with the smallest makespan wins,
among those whose every rank fits the memory limit.

Search: every split when there are at most ``budget`` of them (exact). Otherwise descents from the given
split, a rank-balanced one and the even one, each moving one block at a time between any two stages while
that shortens the step (moves that ``Simulator.bound`` puts above both the kept splits and the descent's
current split are not replayed), then a depth-first branch and bound over the cut positions: a rank's busy
time never exceeds the makespan, so any partial split whose busiest rank already exceeds the best makespans
kept is dropped unseen. That
holds for the priced loads when a rank's pace follows its wait too (``PartCosts.pace`` = k, within
``PACE_RANGE``): at the fixed point a rank's paced busy time is b = L (1 + k (1 - b / M)) for its
priced load L and the step M, with b <= M. For k >= 0 its pace is at least 1, so M >= b >= L. For
k < 0, b = L (1 + k) / (1 + k L / M), and M < L would give 1 + k L / M < 1 + k, so b > L > M. If the
budget runs out first (splits replayed, or partial splits visited), the result is still a valid split and the
search states a lower bound on the optimum, so the gap is known: the largest of the smallest bound of the parts it
did not explore, the average rank's least work (``Simulator.least_work``), and the step of the best fractional
split (``Simulator.relaxed_bound``: a replay's step is its longest chain of actions, a line in the stages' sizes).
"""

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from trainer.parallel.pipeline_cost import KINDS, PartCosts
from trainer.parallel.schedule_sim import Program, critical_path, replay, replay_paced

# Action-replays (actions x candidates) of the whole search when it lists every split, else of its branch and bound.
REPLAY_BUDGET = 2_000_000
# Action-replays that choose the pace run (most_unequal_split): its random draw where there are more splits.
UNEQUAL_REPLAYS = 200_000
# Action-replays of the descents from the seeds, by default (moves a bound rules out are not replayed). With the
# branch and bound: 0.9-8.1 s a search for 8B and 70B at pp 4-16 on this project's CPU, planning alone (no memory
# limit; the dry run's bound up to 1.1 s more), and up to 8.2% faster splits than 200,000 in all
# (benchmarks/bench_planner_search.py).
DESCENT_REPLAYS = 20_000_000
# Partial splits the branch and bound may visit per replay in its budget (a visit prices its children's stage loads
# from running sums, no replay).
NODES_PER_REPLAY = 100
# Replays of the split's continuous relaxation at most (Simulator.relaxed_bound): 19-174 settled it within 0.1%
# for 8B and 70B at pp 4-16 (benchmarks/bench_planner_search.py).
RELAXATION_ROUNDS = 300
# Replays of a paced prediction, a typical count (schedule_sim.replay_paced's rounds and the last one).
PACED_REPLAYS = 12


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
    rank_bound: float
    """No split's makespan is below this (equal to the best one's when exact): from the ranks' loads."""
    refused_for_memory: int
    """Splits evaluated and dropped because a rank would exceed the memory limit."""
    visited: int = 0
    """Partial splits the branch and bound priced (at most NODES_PER_REPLAY x the replay budget)."""
    relaxation: Callable[[], float | None] | None = field(default=None, compare=False, repr=False)
    """The split's continuous relaxation (``Simulator.relaxed_bound``) of an inexact search, not yet run."""

    @functools.cached_property
    def lower_bound(self) -> float:
        """No split's makespan is below this: ``rank_bound`` raised by the relaxation. Run when first asked for: the
        dry run states it, a launch never asks (up to 1.1 s of every rank's start-up for 70B at pp 16)."""
        relaxed = self.relaxation() if self.relaxation is not None else None
        bound = self.rank_bound if relaxed is None else max(self.rank_bound, relaxed)
        return min(bound, self.best[0].makespan) if self.best else bound


class Simulator:
    """Replays one schedule with the costs of any split of the blocks into its stages."""

    def __init__(self, costs: PartCosts, program: Program):
        self.costs, self.program = costs, program
        self.stage_ids = [sorted({program.actions[a][1] for a in ids}) for ids in program.order]
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
        stage, which needs the forwards below) plus the rank's busy time. Paced (k >= 0) both only grow; for a pace
        below 0 the busy time alone (the module's note)."""
        owner, send, f, last = self.owner, self.costs.send, KINDS.index("F"), len(counts) - 1
        loads, reach, start = [0.0] * len(self.stage_ids), [0.0], 0
        for s, c in enumerate(counts):
            values = self._values(s, start, start + c)
            loads[owner[s]] += sum(self.counts[k][s] * v for k, v in enumerate(values))
            reach.append(reach[-1] + values[f] + (send if s < last and owner[s] != owner[s + 1] else 0.0))
            start += c
        if self.costs.pace < 0:
            return max(loads)
        return max(reach[self._first[r]] + load for r, load in enumerate(loads))

    def least_work(self) -> float:
        """At most the least the ranks work in all over every split. The first stage holds the first c blocks and
        runs their whole backward as its W (its I computes nothing, and a measured B need not be I + W); every other
        block goes to the later stage where it costs least; plus what each stage costs without blocks; the least
        over c. Exact where every later stage runs the same actions (not DualPipeV, whose stages run B or I and W
        by rank and step, nor every CSV schedule); a lower bound always."""
        n, stages = self.costs.num_blocks, self.program.num_stages
        empty = [self.load_of(s, 0, 0) for s in range(stages)]
        if stages == 1:
            return self.load_of(0, 0, n)
        later = [min(self.load_of(s, b, b + 1) - empty[s] for s in range(1, stages)) for b in range(n)]
        tail = list(itertools.accumulate(reversed(later), initial=0.0))[::-1]  # tail[c]: blocks c .. n - 1
        return sum(empty[1:]) + min(self.load_of(0, 0, c) + tail[c] for c in range(1, n - stages + 2))

    def relaxed_bound(self, rounds: int = RELAXATION_ROUNDS, tolerance: float = 1e-3) -> float | None:
        """A step no split can beat, from the split's continuous relaxation: stage s holds x_s >= 1 blocks (any real
        number, summing to the blocks), each action costing what its stage costs empty plus x_s times the least a
        block costs in that kind. A replay's step is its longest chain of actions (``schedule_sim.critical_path``):
        each chain found is a line under the step at every x, and no split's step is below the best mix of those
        lines at its lowest corner of the x simplex (every block costs at least the least; a paced step, k >= 0, only
        adds). The chains come from Kelley's cutting planes: replay at the x where the mix so far is lowest, until
        the step found there is within ``tolerance`` of the bound, or ``rounds`` replays (-inf for none). For equal
        blocks it is the best fractional split's step (within ``tolerance``, unless the rounds run out), below the
        best split's by what whole blocks cost. None for a pace below 0."""
        if self.costs.pace < 0:
            return None
        n, stages, kinds = self.costs.num_blocks, self.program.num_stages, range(len(KINDS))
        empty = [self._values(s, 0, 0) for s in range(stages)]
        # The least one block adds to each kind of each stage (the first stage's I and W as _values prices them)
        per_block = []
        for s in range(stages):
            one = [self._values(s, b, b + 1) for b in range(n)]
            per_block.append([min(v[k] for v in one) - empty[s][k] for k in kinds])
        actions, send = self.program.actions, self.costs.send
        kind_of = [KINDS.index(kind) for kind, _, _ in actions]
        x, levels, slopes, lower, upper = [n / stages] * stages, [], [], -math.inf, math.inf
        for _ in range(rounds):
            table = [[empty[s][k] + per_block[s][k] * x[s] for s in range(stages)] for k in kinds]
            spans: list = []
            upper = min(upper, replay(self.program, table, send, spans)[0])
            path, transfers = critical_path(self.program, spans, send)
            level, slope = transfers * send, [0.0] * stages
            for a in path:
                stage, k = actions[a][1], kind_of[a]
                level += empty[stage][k]
                slope[stage] += per_block[stage][k]
            levels.append(level)
            slopes.append(slope)
            # Each chain's line at each corner (x_s = n - stages + 1, the others 1): a mix of chains is a bound
            # at its lowest corner, whatever the mix; the game's mix makes it the highest.
            lines = np.array(slopes)
            corners = np.array(levels)[:, None] + lines.sum(1, keepdims=True) + (n - stages) * lines
            mix, where = _solve_game(corners)
            lower = max(lower, float((mix @ corners).min()))
            if upper - lower <= tolerance * upper:
                break
            x = list(1.0 + (n - stages) * where)
        return lower

    @property
    def replays(self) -> int:
        """Replays of the schedule per predicted split, about (a paced one's rounds: PACED_REPLAYS)."""
        return PACED_REPLAYS if self.costs.pace else 1

    def predict(self, counts: tuple[int, ...], spans: list | None = None) -> Prediction:
        table, send, pace = self.costs.stage_table(counts), self.costs.send, self.costs.pace
        makespan, busy = (replay_paced(self.program, table, send, pace, spans) if pace else
                          replay(self.program, table, send, spans))
        return Prediction(tuple(counts), makespan, tuple(busy))


def search_splits(sim: Simulator, *, fits: Callable[[tuple[int, ...]], bool] | None = None,
                  budget: int | None = None, keep: int = 4, seed: tuple[int, ...] | None = None,
                  enumerate_up_to: int | None = None) -> SplitSearch:
    """The ``keep`` best contiguous splits of ``sim``'s blocks into its stages by simulated makespan.

    ``fits(counts)``: whether every rank of that split fits its memory (None: no limit). ``budget``:
    most splits to replay in the whole search (default: REPLAY_BUDGET action-replays to list every split or for
    the branch and bound, DESCENT_REPLAYS for the descents before it). ``seed``: a split to start from.
    ``enumerate_up_to``: list every split when there are at most this many (default: the budget)."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    explicit = budget is not None
    if budget is None:
        budget = max(64, REPLAY_BUDGET // max(len(sim.program.actions) * sim.replays, 1))
    total = math.comb(n - 1, stages - 1)
    # A max-heap of the best by (makespan, then the sum of squared stage loads), negated: where the
    # simulation cannot tell splits apart (a rank off the critical path holds two stages: any division
    # of its blocks between them ties), the most even stages win, as they are the least exposed to
    # costs the model misses.
    kept: list[tuple[float, float, tuple[int, ...], Prediction]] = []
    seen: set[tuple[int, ...]] = set()
    state = {"evaluated": 0, "refused": 0, "visited": 0}

    def threshold() -> float:
        return -kept[0][0] if len(kept) == keep else math.inf

    def rank_key(pred: Prediction) -> tuple[float, float]:
        table = sim.costs.stage_table(pred.counts)
        # makespans equal but for rounding count as ties
        return float(f"{pred.makespan:.9g}"), sum(sim.stage_load(table, s) ** 2 for s in range(sim.program.num_stages))

    def evaluate(counts: tuple[int, ...]) -> Prediction | None:
        if counts in seen:
            return None
        seen.add(counts)
        state["evaluated"] += 1
        if fits is not None and not fits(counts):
            state["refused"] += 1
            return None
        pred = sim.predict(counts)
        if pred.makespan <= threshold() * (1 + 1e-8):
            makespan, spread = rank_key(pred)
            if len(kept) < keep or (makespan, spread) < (-kept[0][0], -kept[0][1]):
                heapq.heappush(kept, (-makespan, -spread, counts, pred))
                if len(kept) > keep:
                    heapq.heappop(kept)
        return pred

    if total <= (budget if enumerate_up_to is None else enumerate_up_to):
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *cuts, n)
            evaluate(tuple(b - a for a, b in zip(bounds, bounds[1:])))
        return _result(kept, total, state, exact=True, lower=None)

    # Incumbents first (sharp pruning): the given seed, the rank-balanced split and the even one,
    # each walked downhill.
    even = tuple(n // stages + (1 if s < n % stages else 0) for s in range(stages))
    # A given budget bounds the whole search; by default the descents have their own, the branch and bound its own.
    descents = budget if explicit else max(budget, DESCENT_REPLAYS // max(len(sim.program.actions) * sim.replays, 1))

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
    lower = _branch_and_bound(sim, n, stages, evaluate, threshold, budget, nodes, state)
    relaxation = None
    if lower is not None:  # some rank works at least the average: the step is at least the least average
        lower = max(lower, sim.least_work() / len(sim.stage_ids))
        # the relaxation's replays count against a given budget too (its rounds are one replay each)
        rounds = max(budget - state["evaluated"], 0) * sim.replays if explicit else RELAXATION_ROUNDS
        relaxation = functools.partial(sim.relaxed_bound, min(rounds, RELAXATION_ROUNDS))
    return _result(kept, total, state, exact=lower is None, lower=lower, relaxation=relaxation)


def most_unequal_split(sim: Simulator, cap: int | None = None,
                       skip: tuple[int, ...] | None = None) -> tuple[Prediction, int]:
    """(the split whose ranks' predicted bubbles differ most, how many splits were compared): every contiguous
    split but ``skip``, or ``cap`` of them drawn with a fixed seed where there are more (default: as many as
    UNEQUAL_REPLAYS allows). A timed run of it fits the pace (``pipeline_cost.fit_pace``) from ranks that
    wait as unequally as the model allows."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    if cap is None:
        cap = max(16, UNEQUAL_REPLAYS // max(len(sim.program.actions) * sim.replays, 1))
    rng = random.Random(0)
    cuts = (itertools.combinations(range(1, n), stages - 1) if math.comb(n - 1, stages - 1) <= cap else
            [tuple(sorted(rng.sample(range(1, n), stages - 1))) for _ in range(cap)])
    best, compared = None, set()
    for cut in cuts:
        counts = tuple(b - a for a, b in zip((0, *cut), (*cut, n)))
        if counts in compared or counts == skip:
            continue
        compared.add(counts)
        pred = sim.predict(counts)
        bubbles = [pred.bubble(r) for r in range(len(pred.busy))]
        if best is None or max(bubbles) - min(bubbles) > best[0]:
            best = (max(bubbles) - min(bubbles), pred)
    return best[1], len(compared)


def _rank_balanced(sim: Simulator) -> tuple[int, ...]:
    """Cuts that give every rank the same work: each stage aims at its rank's share, less what the
    rank's first or last stage carries (embeddings, output), spread over the rank's stages."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    one = sim.costs.stage_table([1] * stages) if n >= stages else None
    if one is None:
        return tuple([1] * stages)
    per_block = [sim.stage_load(sim.costs.stage_table([1] * stages), 1 if stages > 2 else 0)] * n
    # Block loads from single-block stages in the middle; pre/post from the end stages' excess.
    table = sim.costs.stage_table([1] * (stages - 1) + [n - stages + 1]) if stages > 1 else one
    extra_first = sim.stage_load(one, 0) - per_block[0]
    extra_last = sim.stage_load(table, stages - 1) - per_block[0] * (n - stages + 1)
    total = per_block[0] * n + extra_first + extra_last
    owner = sim.owner
    share = total / len(sim.stage_ids)
    target = []
    for s in range(stages):
        r = owner[s]
        extra = ((extra_first if 0 in sim.stage_ids[r] else 0.0)
                 + (extra_last if stages - 1 in sim.stage_ids[r] else 0.0))
        target.append(max(share - extra, 0.0) / len(sim.stage_ids[r]))
    weights = [t / per_block[0] for t in target]  # blocks each stage should get
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


def _solve_game(payoff: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row mix, column mix) of the zero-sum game in which rows choose to raise ``payoff`` and columns to lower it,
    by the simplex method on max sum(z) for payoff' z <= 1, z >= 0 (payoff' = payoff shifted above 0 and scaled into
    (0, 1]; Bland's rule). The row mix comes from the final tableau's prices; a caller scores it on ``payoff``
    itself, so any mix it returns gives a true bound."""
    rows, cols = payoff.shape
    table = np.zeros((rows + 1, cols + rows + 1))
    shifted = payoff - payoff.min() + 1.0
    table[:rows, :cols] = shifted / shifted.max()  # in (0, 1]: the tolerances below are relative to the largest
    table[:rows, cols:cols + rows] = np.eye(rows)
    table[:rows, -1] = 1.0
    table[rows, :cols] = -1.0
    basis = list(range(cols, cols + rows))
    for _ in range(50 * (rows + cols)):
        entering = np.flatnonzero(table[rows, :-1] < -1e-9)
        if not entering.size:
            break
        e = int(entering[0])
        column = table[:rows, e]
        ratios = np.where(column > 1e-9, table[:rows, -1] / np.where(column > 1e-9, column, 1.0), np.inf)
        if not np.isfinite(ratios.min()):
            break  # unbounded: not for a payoff above 0
        ties = np.flatnonzero(ratios <= ratios.min() + 1e-12 * max(1.0, abs(ratios.min())))
        r = int(min(ties, key=lambda i: basis[i]))
        table[r] /= table[r, e]
        pivot = table[r].copy()
        table -= np.outer(table[:, e], pivot)
        table[r] = pivot
        basis[r] = e
    prices = np.maximum(table[rows, cols:cols + rows], 0.0)
    z = np.zeros(cols)
    for i, b in enumerate(basis):
        if b < cols:
            z[b] = max(table[i, -1], 0.0)
    mix = prices / prices.sum() if prices.sum() > 0 else np.full(rows, 1.0 / rows)
    return mix, (z / z.sum() if z.sum() > 0 else np.full(cols, 1.0 / cols))


def _descend(counts: tuple[int, ...], evaluate, budget: int, state: dict, skip=None) -> Prediction | None:
    """Move one block from one stage to another while that shortens the step (first improvement; neighbouring
    stages first); returns where it stopped. A block moved between stages further apart shifts every cut between
    them: how a rank's two stages of a V placement trade a block, which one cut at a time would pass through worse
    splits. ``skip(counts, current step)``: a move not to replay."""
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
                      state: dict) -> float | None:
    """Visit the splits whose busiest rank stays under the current threshold; None when all were seen,
    else the smallest rank-load bound among the parts left unexplored when the budget ran out (``budget``
    replays in all, or ``nodes`` partial splits visited)."""
    owner = sim.owner
    unexplored = [math.inf]
    loads = [0.0] * len(sim.stage_ids)
    slack = 1 + 1e-8  # as evaluate's tie window (steps rounded to 9 digits); running sums differ in the last bits

    def visit(prefix: list[int], used: int) -> None:
        bound = max(loads)
        if bound >= threshold() * slack:
            return
        if state["evaluated"] >= budget or state["visited"] >= nodes:
            unexplored[0] = min(unexplored[0], bound)
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
    return None if unexplored[0] == math.inf else unexplored[0]


def _result(kept, total: int, state: dict, *, exact: bool, lower: float | None, relaxation=None) -> SplitSearch:
    best = tuple(p for *_, p in sorted(kept, key=lambda k: (-k[0], -k[1], k[2])))
    if best:
        lower = best[0].makespan if lower is None else min(lower, best[0].makespan)
    return SplitSearch(best, total, state["evaluated"], exact, lower if lower is not None else math.inf,
                       state["refused"], state["visited"], relaxation)
