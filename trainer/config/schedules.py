"""What each ``[parallelism] pipeline_parallel_schedule`` name means: one table.

The schema's accepted names, the stage counts and placement of the pipeline plan, the rules
checked at load and the rank that reports metrics are all read from here.
"""

from dataclasses import dataclass
from typing import Literal


CSV_KEY = "[parallelism] pipeline_parallel_schedule_csv"
"""The key of a custom schedule's action file (``pipeline_parallel_schedule = "csv"``)."""


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


SCHEDULES: dict[str, ScheduleTraits] = {
    "GPipe": ScheduleTraits("ScheduleGPipe", "one", "loop", False),
    "1F1B": ScheduleTraits("Schedule1F1B", "one", "loop", False),
    "Interleaved1F1B": ScheduleTraits("ScheduleInterleaved1F1B", "many", "loop", False),
    "LoopedBFS": ScheduleTraits("ScheduleLoopedBFS", "many", "loop", False),
    "InterleavedZeroBubble": ScheduleTraits("ScheduleInterleavedZeroBubble", "many", "loop", True),
    "ZBVZeroBubble": ScheduleTraits("ScheduleZBVZeroBubble", "two", "v", True),
    "DualPipeV": ScheduleTraits("ScheduleDualPipeV", "two", "v", True),
}

# A schedule from [parallelism] pipeline_parallel_schedule_csv: any number of stages per rank,
# loop placement; its actions may split the backward.
CSV = ScheduleTraits("_PipelineScheduleRuntime", "many", "loop", True)

ScheduleName = Literal[tuple(SCHEDULES)]  # type: ignore[valid-type]
