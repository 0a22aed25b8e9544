"""What each ``[parallelism] pipeline_parallel_schedule`` name means: one table.

The schema's accepted names, the stage counts and placement of the pipeline plan, the rules
checked at load, the rank that reports metrics, where the simulator takes each rank's action
order and whether the bubble has a closed form are all read from here: no other module names a
schedule.
"""

from dataclasses import dataclass
from typing import Literal


CSV_KEY = "[parallelism] pipeline_parallel_schedule_csv"
"""The key of a custom schedule's action file."""
CSV_NAME = "csv"
"""The schedule's name in the plan when its actions come from ``pipeline_parallel_schedule_csv``."""


@dataclass(frozen=True)
class ScheduleTraits:
    torch_class: str
    """Class in torch.distributed.pipelining.schedules."""
    stages_per_rank: Literal["one", "two", "many"]
    """one: single-stage schedules; two: exactly two (V schedules); many: two or more (virtual stages)."""
    placement: Literal["loop", "v"]
    """loop: rank r holds stages r, r + pp, ...; v: rank r holds r and 2 pp - 1 - r (first and last together)."""
    split_backward: bool
    """Backward runs as separate input-gradient and weight-gradient passes (zero-bubble schedules)."""
    order: Literal["torch", "forwards_then_backwards", "fill_alternate_drain", "file"] = "torch"
    """Where each rank's action order comes from: torch's action lists; for one stage per rank an order of
    our own (torch's lists are not usable there), every forward then every backward (GPipe) or fill,
    alternate one forward and one backward, drain (1F1B); or the CSV file."""

    @property
    def fill_drain(self) -> bool:
        """One stage per rank filled and drained: the idle fraction is (pp - 1) / (m + pp - 1), no simulation."""
        return self.order in ("forwards_then_backwards", "fill_alternate_drain")

    @property
    def from_file(self) -> bool:
        """The actions are read from ``[parallelism] pipeline_parallel_schedule_csv``."""
        return self.order == "file"


SCHEDULES: dict[str, ScheduleTraits] = {
    "GPipe": ScheduleTraits("ScheduleGPipe", "one", "loop", False, "forwards_then_backwards"),
    "1F1B": ScheduleTraits("Schedule1F1B", "one", "loop", False, "fill_alternate_drain"),
    "Interleaved1F1B": ScheduleTraits("ScheduleInterleaved1F1B", "many", "loop", False),
    "LoopedBFS": ScheduleTraits("ScheduleLoopedBFS", "many", "loop", False),
    "InterleavedZeroBubble": ScheduleTraits("ScheduleInterleavedZeroBubble", "many", "loop", True),
    "ZBVZeroBubble": ScheduleTraits("ScheduleZBVZeroBubble", "two", "v", True),
    "DualPipeV": ScheduleTraits("ScheduleDualPipeV", "two", "v", True),
}

# A schedule from [parallelism] pipeline_parallel_schedule_csv: any number of stages per rank,
# loop placement; its actions may split the backward.
CSV = ScheduleTraits("_PipelineScheduleRuntime", "many", "loop", True, "file")


def traits_of(name: str) -> ScheduleTraits:
    """The traits of a plan's schedule name (a table row, or ``CSV_NAME``)."""
    return CSV if name == CSV_NAME else SCHEDULES[name]


def schedule_traits(parallelism) -> tuple[str, ScheduleTraits]:
    """(schedule name or ``CSV_NAME``, its traits) of a ``[parallelism]`` section."""
    name = CSV_NAME if parallelism.pipeline_parallel_schedule_csv else parallelism.pipeline_parallel_schedule
    return name, traits_of(name)


ScheduleName = Literal[tuple(SCHEDULES)]  # type: ignore[valid-type]
