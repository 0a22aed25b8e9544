"""A pipeline schedule without a process group: its action lists (torch's, through the private
``torch.distributed.pipelining._schedule_visualizer``, called here only; or a CSV file), their checks, and
the one replay of them that the planner, the dry run, the bubble and the timeline all use."""

import re
import statistics
from dataclasses import dataclass
from functools import cache

from trainer.config.schedules import CSV_KEY, traits_of
from trainer.errors import ConfigError

# The action kinds, as the CSV cells and the trace name them; a table of costs is indexed in this order.
KINDS = ("F", "B", "I", "W")
KIND_NAMES = {"F": "forward", "B": "full backward", "I": "input gradient", "W": "weight gradient"}
_TORCH_KINDS = dict(zip(("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"), KINDS))
# Relative compute cost of an action on one stage: backward is twice forward, split in equal halves.
UNIT_COST = dict(zip(KINDS, (1.0, 2.0, 1.0, 1.0)))
Action = tuple[str, int, int]
"""(kind, stage, microbatch)"""


@cache
def schedule_ops(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> list[list]:
    """Each pipeline rank's ordered compute actions (torch _Action objects; None = idle slot)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return get_schedule_ops(schedule, pp, n_microbatches, num_stages_per_rank=stages_per_rank)


def check_schedule(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> None:
    """Raise a ConfigError when torch would reject this schedule configuration."""
    try:
        schedule_ops(schedule, pp, n_microbatches, stages_per_rank)
    except ImportError:  # older torch without the helper: torch checks again when the schedule is built
        return
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ConfigError(f"[parallelism] pipeline_parallel_schedule={schedule} with {n_microbatches} microbatches"
                          f" ([training] local_batch_size / pipeline_parallel_microbatch_size) on {pp} ranks x"
                          f" {stages_per_rank} stages: {str(e).strip().splitlines()[0]}") from None


def check_csv(path: str, placement: list[list[int]], n_microbatches: int) -> None:
    """The CSV (one row of compute actions like 0F0,2B1 per pipeline rank) must be a schedule torch can run on
    this job: rank r's actions on its stages ``placement[r]``, each microbatch of each stage run forward once and
    backward once (B, or I then W), in an order in which no rank waits forever for another."""
    key = CSV_KEY
    rows = [[(k, s, m) for s, k, m in row] for row in csv_rows(path)]
    pp, num_stages = len(placement), sum(len(stages) for stages in placement)
    if len(rows) != pp:
        raise ConfigError(f"{key}: {path} has {len(rows)} rows, one per pipeline rank is needed ({pp})")
    stages = {s for row in rows for _, s, _ in row}
    mbs = {mb for row in rows for _, _, mb in row}
    if stages != set(range(num_stages)):
        raise ConfigError(f"{key}: {path} uses stages {sorted(stages)}, but the job has stages 0..{num_stages - 1}"
                          " (as many as the CSV uses, unless [parallelism] pipeline_parallel_split_points or"
                          " pipeline_parallel_layers_per_stage set them)")
    if mbs != set(range(n_microbatches)):
        raise ConfigError(f"{key}: {path} uses microbatches {sorted(mbs)}, but the job has {n_microbatches}"
                          " ([training] local_batch_size / pipeline_parallel_microbatch_size)")
    owner = {stage: r for r, held in enumerate(placement) for stage in held}
    rule = ", ".join("r" if i == 0 else f"r+{i * pp}" for i in range(len(placement[0])))  # the CSV runtime's loop
    for r, row in enumerate(rows):
        for kind, stage, mb in row:
            if owner[stage] != r:
                raise ConfigError(f"{key}: {path} row {r + 1} (pipeline rank {r}) has {stage}{kind}{mb}, but stage"
                                  f" {stage} runs on rank {owner[stage]} (rank r holds stages {rule}); rows go in"
                                  " pipeline-rank order")
    where: dict[tuple[str, int, int], list[int]] = {}  # action -> its positions in its rank's row
    for row in rows:
        for i, action in enumerate(row):
            where.setdefault(action, []).append(i)
    for stage in range(num_stages):
        for mb in range(n_microbatches):
            count = {kind: len(where.get((kind, stage, mb), [])) for kind in KINDS}
            if count["F"] != 1:
                raise ConfigError(f"{key}: {path}: stage {stage} microbatch {mb} runs forward {count['F']} times"
                                  f" ({stage}F{mb}); once is needed")
            if (count["B"], count["I"], count["W"]) not in ((1, 0, 0), (0, 1, 1)):
                found = ", ".join(f"{n} x {stage}{k}{mb}" for k, n in count.items() if k != "F" and n) or "none"
                raise ConfigError(f"{key}: {path}: stage {stage} microbatch {mb} needs one backward, {stage}B{mb} or"
                                  f" {stage}I{mb} then {stage}W{mb} (found {found})")
            first = {kind: where[(kind, stage, mb)][0] for kind in KINDS if count[kind]}
            for later, earlier in (("B", "F"), ("I", "F"), ("W", "I")):
                if later in first and first[later] < first[earlier]:
                    raise ConfigError(f"{key}: {path} row {owner[stage] + 1}: {stage}{later}{mb} comes before"
                                      f" {stage}{earlier}{mb}")
    try:
        unit_replay(compile_program(rows, num_stages))
    except Deadlock as e:
        stuck = "; ".join(f"rank {r} at {s}{k}{mb}" for r, (k, s, mb) in e.blocked)
        raise ConfigError(f"{key}: {path}: this order cannot run, every rank waits for another ({stuck})") from None


def csv_rows(path: str) -> list[list[tuple[int, str, int]]]:
    """Each row's (stage, kind, microbatch) cells of a CSV schedule whose syntax was checked at load."""
    from trainer.config.validate import read_csv_cells

    rows = []
    for row in read_csv_cells(path):
        cells = [re.fullmatch(r"(\d+)([FBIW])(\d+)", cell) for cell in row if cell]  # empty = idle slot
        rows.append([(int(m.group(1)), m.group(2), int(m.group(3))) for m in cells])
    return rows


class Deadlock(RuntimeError):
    """No rank can run its next action; ``blocked`` holds (rank, next action) of each unfinished rank."""

    def __init__(self, blocked: list[tuple[int, tuple[str, int, int]]]):
        super().__init__("pipeline schedule simulation deadlocked")
        self.blocked = blocked


def _flatten(action) -> list[Action]:
    if action is None:
        return []
    if action.sub_actions:
        return [x for sub in action.sub_actions for x in _flatten(sub)]
    # by name: older torch releases numbered these types instead of lettering them
    kind = _TORCH_KINDS.get(action.computation_type.name)
    if kind is None:  # communication, resharding, gradient reduction: not compute
        return []
    return [(kind, action.stage_index, action.microbatch_index)]


def lowered(ops: list[list]) -> tuple[list[list[Action]], dict[Action, Action]]:
    """Each rank's compute actions in order (torch's action lists flattened), and {action: the action after which
    its output is sent} for the actions an overlapped pair runs before its last (docs/pipeline.md, "The
    simulation"; torch's lowering, ``schedules._add_send_recv``, sends after the whole pair)."""
    queues, sent_after = [], {}
    for rank_ops in ops:
        queue = []
        for a in rank_ops:
            flat = _flatten(a)
            for x in flat[:-1]:
                sent_after[x] = flat[-1]
            queue += flat
        queues.append(queue)
    return queues, sent_after


@dataclass(frozen=True)
class Program:
    """A schedule compiled for replay: each rank's actions in order, and what each action waits for
    (docs/pipeline.md, "The simulation")."""

    actions: tuple[Action, ...]
    """Every action; index = action id."""
    order: tuple[tuple[int, ...], ...]
    """Each rank's action ids in the order it runs them."""
    deps: tuple[tuple[tuple[int, bool], ...], ...]
    """Per action: (action id it waits for, whether that one ran on another rank); -1 = never made."""
    num_stages: int

    @property
    def num_ranks(self) -> int:
        return len(self.order)

    def owner(self) -> dict[int, int]:
        return {self.actions[a][1]: r for r, ids in enumerate(self.order) for a in ids}

    def stage_ids(self) -> list[list[int]]:
        """Each rank's stages, in order."""
        return [sorted({self.actions[a][1] for a in ids}) for ids in self.order]


def compile_program(queues: list[list[Action]], num_stages: int, sent_after: dict | None = None) -> Program:
    """``sent_after``: ``lowered``'s {action: the later action of its rank after which torch sends its output}."""
    sent_after = sent_after or {}
    actions = [a for q in queues for a in q]
    ids = {a: i for i, a in enumerate(actions)}
    owner = {stage: r for r, q in enumerate(queues) for _, stage, _ in q}
    order, i = [], 0
    for q in queues:
        order.append(tuple(range(i, i + len(q))))
        i += len(q)

    def dep(stage: int, *kinds: str, mb: int, me: int) -> tuple[int, bool]:
        found = [(k, stage, mb) for k in kinds if (k, stage, mb) in ids]
        cross = owner.get(stage, me) != me
        if not found:
            return -1, cross
        return ids[sent_after.get(found[0], found[0]) if cross else found[0]], cross

    deps = []
    for kind, stage, mb in actions:
        me = owner[stage]
        need = []
        if kind == "F" and stage > 0:
            need.append(dep(stage - 1, "F", mb=mb, me=me))
        if kind in ("B", "I"):
            need.append(dep(stage, "F", mb=mb, me=me))
            if stage < num_stages - 1:
                need.append(dep(stage + 1, "I", "B", mb=mb, me=me))
        if kind == "W":
            need.append(dep(stage, "I", mb=mb, me=me))
        deps.append(tuple(need))
    return Program(tuple(actions), tuple(order), tuple(deps), num_stages)


def cost_table(program: Program, cost) -> list[list[float]]:
    """``table[kind index][stage]`` (KINDS order) of ``cost(kind, stage)``, asked only for the (kind, stage) pairs
    the program runs."""
    used = {a[:2] for a in program.actions}
    return [[cost(k, s) if (k, s) in used else 0.0 for s in range(program.num_stages)] for k in KINDS]


def replay(program: Program, table: list[list[float]], send: float = 0.0,
           spans: list | None = None) -> tuple[float, list[float]]:
    """(makespan, busy time of each rank) running every rank's actions in order as early as their inputs
    allow. ``table[k][stage]``: duration of an action of kind ``KINDS[k]`` on ``stage``; ``send``: time of a
    transfer between ranks. Raises ``Deadlock`` when no rank can go on. ``spans``, if given, receives (rank,
    kind, stage, microbatch, start, end) of every action."""
    n = len(program.actions)
    done = [-1.0] * (n + 1)  # finish time; the extra slot stands for an action that never runs (id -1)
    kinds = [KINDS.index(a[0]) for a in program.actions]
    stages = [a[1] for a in program.actions]
    ranks = program.num_ranks
    clock, busy, pos = [0.0] * ranks, [0.0] * ranks, [0] * ranks
    remaining = n
    while remaining:
        progressed = False
        for r in range(ranks):
            queue, i = program.order[r], pos[r]
            while i < len(queue):
                a = queue[i]
                at = 0.0
                for d, cross in program.deps[a]:
                    t = done[d]
                    if t < 0.0:
                        break
                    if cross:
                        t += send
                    if t > at:
                        at = t
                else:
                    duration = table[kinds[a]][stages[a]]
                    begin = clock[r] if clock[r] > at else at
                    clock[r] = done[a] = begin + duration
                    busy[r] += duration
                    if spans is not None:
                        kind, stage, mb = program.actions[a]
                        spans.append((r, kind, stage, mb, begin, clock[r]))
                    i += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
            pos[r] = i
        if not progressed:
            raise Deadlock([(r, program.actions[q[pos[r]]]) for r, q in enumerate(program.order) if pos[r] < len(q)])
    return max(clock), busy


def unit_replay(program: Program, spans: list | None = None) -> tuple[float, list[float]]:
    """``replay`` at ``UNIT_COST`` (a stage being 1/v of a rank's layers) with free communication."""
    v = program.num_stages // program.num_ranks
    return replay(program, cost_table(program, lambda kind, stage: UNIT_COST[kind] / v), spans=spans)


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """Expected idle fraction of the pipeline ranks' time (compute costs: F=1, B=2, I=W=1)."""
    if pp == 1:
        return 0.0
    if traits_of(schedule).fill_drain:
        # Fill and drain: p - 1 slots of (F + B) idle out of m + p - 1.
        return (pp - 1) / (n_microbatches + pp - 1)
    makespan, busy = unit_replay(program_for(schedule, pp, n_microbatches, stages_per_rank))
    return 1.0 - sum(busy) / (pp * makespan)


def simulated_spans(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> list[tuple]:
    """(rank, kind, stage, microbatch, start, end) of every action in the simulation (F = 1 unit)."""
    spans: list[tuple] = []
    unit_replay(program_for(schedule, pp, n_microbatches, stages_per_rank), spans)
    return spans


def program_for(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int, csv: str = "") -> Program:
    """The compiled action lists of a named schedule, or of the CSV file ``csv`` for a schedule from a file."""
    traits = traits_of(schedule)
    if traits.from_file:
        return compile_program([[(k, s, m) for s, k, m in row] for row in csv_rows(csv)], pp * stages_per_rank)
    if traits.order != "torch":  # torch's action lists for one stage per rank are not usable here
        return compile_program([_one_stage_ops(traits.order, pp, n_microbatches, r) for r in range(pp)], pp)
    queues, sent_after = lowered(schedule_ops(schedule, pp, n_microbatches, stages_per_rank))
    return compile_program(queues, pp * stages_per_rank, sent_after)


def replayed_span(program: Program, actions: list[tuple[str, int, float]], spans: list | None = None) -> float:
    """The span of one step of ``program`` when every action of a kind on a stage lasts the median of the
    measured ``actions`` (kind, stage, seconds) and communication is free (the bubble model of a timed run)."""
    samples: dict[tuple[str, int], list[float]] = {}
    for kind, stage, seconds in actions:
        samples.setdefault((kind, stage), []).append(seconds)
    median = {key: statistics.median(values) for key, values in samples.items()}

    def cost(kind: str, stage: int) -> float:
        if (kind, stage) in median:
            return median[(kind, stage)]
        if kind == "B" and ("I", stage) in median:  # a full backward = input grad + weight grad
            return median[("I", stage)] + median.get(("W", stage), 0.0)
        if kind in ("I", "W") and ("B", stage) in median:
            return median[("B", stage)] / 2
        raise ValueError(f"no measured {kind} action of stage {stage}")

    return replay(program, cost_table(program, cost), spans=spans)[0]


def _one_stage_ops(order: str, pp: int, m: int, rank: int) -> list[Action]:
    """forwards_then_backwards (GPipe): every forward, then every backward. fill_alternate_drain (1F1B):
    pp - 1 - rank forwards to fill the pipeline, then one forward and one backward in turn, then the
    remaining backwards."""
    if order == "forwards_then_backwards":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warm = min(pp - 1 - rank, m)
    ops = [("F", rank, i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", rank, warm + i), ("B", rank, i)]
    return ops + [("B", rank, i) for i in range(m - warm, m)]


def schedule_text(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> str:
    """Each rank's action order as text (stage, kind, microbatch), e.g. 'rank 0: 0F0 0F1 3F0 ...'."""
    if traits_of(schedule).fill_drain:
        return f"{schedule}: each rank runs forwards then backwards of {n_microbatches} microbatches in order\n"
    queues = lowered(schedule_ops(schedule, pp, n_microbatches, stages_per_rank))[0]
    return "".join(f"rank {r}: " + " ".join(f"{s}{k}{m}" for k, s, m in q) + "\n" for r, q in enumerate(queues))
