"""Where the model is cut into pipeline stages (contiguous runs of blocks), and which rank runs which stage: the
split keys checked against the model and the schedule, and the split chosen (docs/pipeline.md, "Splitting")."""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from trainer.config.schedules import ScheduleTraits, schedule_traits, traits_of
from trainer.config.schema import Parallelism
from trainer.errors import ConfigError
from trainer.models.registry import ModelLayout, model_blocks
from trainer.pipeline.cost import PartCosts, part_flops, part_params
from trainer.pipeline.search import Simulator, SplitSearch, search_splits
from trainer.pipeline.simulate import check_csv, check_schedule, csv_rows, program_for

KEY = "[parallelism] pipeline_parallel_"


@dataclass(frozen=True)
class Stage:
    index: int
    blocks: tuple[str, ...]  # keys of the layers ModuleDict, e.g. ("0", "1")
    first: bool
    last: bool


@dataclass(frozen=True)
class PipelinePlan:
    """The stages, their placement on pipeline ranks, and the schedule that drives them."""

    stages: tuple[Stage, ...]
    pp: int
    schedule: str  # a name of the schedule table, or CSV_NAME
    style: Literal["loop", "v"]
    search: SplitSearch | None = None
    """The makespan planner's search, when it chose the split."""
    blocks_attr: str = "layers"
    """The model's blocks container (``ModelLayout.blocks``): split points are named ``<blocks_attr>.<key>``."""

    @property
    def traits(self) -> ScheduleTraits:
        return traits_of(self.schedule)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(s.blocks) for s in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Stages held by ``pp_rank``: loop = r, r+pp, ...; V = r and 2pp-1-r."""
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)]

    def rank_of_stage(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stage_ids(r))

    def split_points(self) -> list[str]:
        return [f"{self.blocks_attr}.{s.blocks[0]}" for s in self.stages[1:]]


def module_costs(model: nn.Module, layout: ModelLayout, *, mode: Literal["flops", "params"],
                 seq_len: int) -> tuple[float, list[float], float]:
    """(cost of pre-layers, cost of each block, cost of post-layers) of a meta-device model: parameters, or
    forward FLOPs per token (``cost.part_flops``: matmuls and attention scores)."""
    parts = ([mm + attn for mm, attn in part_flops(model, layout, seq_len=seq_len)] if mode == "flops"
             else list(map(float, part_params(model, layout))))
    return parts[0], parts[1:-1], parts[-1]


def balanced_split(pre: float, blocks: list[float], post: float, num_stages: int) -> list[int]:
    """Block counts per stage minimising the most expensive stage (pre on the first, post on the last): an exact
    dynamic programme over contiguous partitions, every stage at least one block."""
    n = len(blocks)
    prefix = list(itertools.accumulate(blocks, initial=0.0))
    inf = float("inf")
    # best[s][i]: smallest max-stage-cost putting blocks[:i] into stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                c = prefix[i] - prefix[j] + (pre if s == 1 else 0.0) + (post if s == num_stages else 0.0)
                value = max(best[s - 1][j], c)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(num_stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def num_stages_for(parallelism: Parallelism, traits: ScheduleTraits, n_layers: int) -> int:
    """Total stages: from split points, from layers per stage, or 1 / 2 per rank by schedule type."""
    pp = parallelism.pipeline_parallel_degree
    if parallelism.pipeline_parallel_split_points:
        return len(parallelism.pipeline_parallel_split_points) + 1
    if parallelism.pipeline_parallel_schedule_csv and parallelism.pipeline_parallel_layers_per_stage is None:
        # A CSV names its stages: as many as it uses (checked against the placement when the job is planned).
        used = [s for row in csv_rows(parallelism.pipeline_parallel_schedule_csv) for s, _, _ in row]
        return max(used) + 1
    if parallelism.pipeline_parallel_layers_per_stage is not None:
        # Uneven counts are fine: round up to whole stages, then to a multiple of pp so every
        # rank holds as many stages; the split then balances layers over them.
        stages = math.ceil(n_layers / parallelism.pipeline_parallel_layers_per_stage)
        return math.ceil(stages / pp) * pp
    return pp if traits.stages_per_rank == "one" else 2 * pp


def build_pipeline_plan(parallelism: Parallelism, model: nn.Module, layout: ModelLayout, *, seq_len: int,
                        n_microbatches: int,
                        costs: Callable[[], PartCosts] | None = None,
                        fits: Callable[[tuple[int, ...], list[list[int]]], bool] | None = None) -> PipelinePlan:
    """Validate the pipeline keys against the model and the schedule, and decide every stage's blocks.

    ``costs()``: the part costs the makespan planner prices splits with (built only when it runs);
    ``fits(counts, placement)``: whether every rank of a split fits the memory limit (None: no limit)."""
    pp = parallelism.pipeline_parallel_degree
    schedule, traits = schedule_traits(parallelism)
    layers_attr = layout.blocks
    block_keys = list(model_blocks(model, layers_attr))
    n_layers = len(block_keys)
    points = parallelism.pipeline_parallel_split_points
    if points:
        # A stage starts at any block but the first (stage 0 starts at the beginning).
        starts = [f"{layers_attr}.{k}" for k in block_keys[1:]]
        shown = ", ".join(starts) if len(starts) <= 12 else ", ".join(starts[:4] + ["..."] + starts[-2:])
        index = {name: i + 1 for i, name in enumerate(starts)}
        for name in points:
            if name not in index:
                raise ConfigError(f"{KEY}split_points: {name!r} cannot start a stage (valid: {shown})")
        positions = [index[n] for n in points]
        if positions != sorted(set(positions)):
            raise ConfigError(f"{KEY}split_points: {points} must be distinct and in model order")
    num_stages = num_stages_for(parallelism, traits, n_layers)
    source = "split points" if parallelism.pipeline_parallel_split_points else "stages"
    if num_stages % pp:
        raise ConfigError(f"{KEY}degree={pp} must divide the number of stages {num_stages} (from {source}); "
                          f"each rank holds the same number of stages")
    per_rank = num_stages // pp
    if traits.stages_per_rank == "one" and per_rank != 1:
        raise ConfigError(f"{KEY}schedule={schedule} runs one stage per rank, but there are {num_stages} stages for"
                          f" {pp} ranks; use a multi-stage schedule (e.g. Interleaved1F1B) or {pp - 1} split points")
    if traits.stages_per_rank != "one" and per_rank < 2 and not traits.from_file:
        raise ConfigError(f"{KEY}schedule={schedule} needs at least 2 stages per rank, got {num_stages} stages for"
                          f" {pp} ranks; give {2 * pp - 1} split points or set pipeline_parallel_layers_per_stage")
    if traits.stages_per_rank == "two" and per_rank != 2:
        raise ConfigError(f"{KEY}schedule={schedule} needs exactly 2 stages per rank, got {per_rank}")
    if num_stages > n_layers:
        raise ConfigError(f"{KEY}degree={pp}: {num_stages} stages ({per_rank} per rank) but the model has only"
                          f" {n_layers} layers")

    if traits.from_file:
        check_csv(parallelism.pipeline_parallel_schedule_csv,
                  [[r + i * pp for i in range(per_rank)] for r in range(pp)], n_microbatches)
    else:
        check_schedule(schedule, pp, n_microbatches, per_rank)
    search = None
    mode = parallelism.pipeline_parallel_split_mode
    if points:
        bounds = [0] + positions + [n_layers]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
    elif mode == "makespan":
        if costs is None:
            raise ValueError("the makespan planner needs the part costs")
        sim = Simulator(costs(), program_for(schedule, pp, n_microbatches, per_rank,
                                             parallelism.pipeline_parallel_schedule_csv))
        search = search_splits(sim, fits=fits)
        if not search.best:
            raise ConfigError(
                f"{KEY}memory_limit_gib: none of the {search.evaluated} splits tried fits every rank"
                f" (state + activations + the loss's gradient); raise the limit or data_parallel_shard_degree, lower"
                " [training] local_batch_size or pipeline_parallel_microbatch_size, or use activation checkpointing")
        counts = list(search.best[0].counts)
    else:
        if mode == "even":
            pre_c, block_c, post_c = (parallelism.pipeline_parallel_embedding_weight, [1.0] * n_layers,
                                      parallelism.pipeline_parallel_output_weight)
        else:
            pre_c, block_c, post_c = module_costs(model, layout, mode=mode, seq_len=seq_len)
        counts = balanced_split(pre_c, block_c, post_c, num_stages)
    stages, start = [], 0
    for s, c in enumerate(counts):
        stages.append(Stage(s, tuple(block_keys[start:start + c]), s == 0, s == num_stages - 1))
        start += c
    return PipelinePlan(tuple(stages), pp, schedule, traits.placement, search, layers_attr)
