"""Measured pipeline timelines: when each schedule action ran on each rank, as a Chrome/Perfetto trace.

For the steps in ``[profiling] pipeline_timeline_steps``, every rank records the start and end of
each compute action its PipelineStages run (forward F, full backward B, input gradient I,
weight gradient W; stage and microbatch) on the wall clock, which the processes of one machine
share (across nodes it is as good as their clock synchronisation). After the step each rank
writes its actions; the reporting rank merges them into
``<dump>/<save_traces_folder>/pipeline_timeline_step<N>.json`` (open it in https://ui.perfetto.dev
or chrome://tracing: one row per rank) and logs the measured bubble of each pipeline rank: the
share of the step's pipeline span (first action start to last action end, over all ranks) in
which that rank ran no action. Waiting for point-to-point transfers shows as gaps.
"""

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

# PipelineStage methods and the action each is; a backward that is not full is the input gradient.
_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class PipelineTimeline:
    """Records this rank's pipeline actions for the chosen steps and merges every rank's on one rank."""

    def __init__(self, steps: list[int], folder: Path, *, rank: int, pp_rank: int, writer: bool):
        self.steps, self.folder = set(steps), Path(folder)
        self.rank, self.pp_rank, self.writer = rank, pp_rank, writer
        self.events: list[dict] | None = None  # recording when not None

    def attach(self, stages) -> None:
        """Wrap each stage's compute methods (on the instances: other stages are untouched)."""
        for stage in stages:
            for name in _METHODS:
                setattr(stage, name, self._timed(stage, name, getattr(stage, name)))

    def _timed(self, stage, name, method):
        def run(*args, **kwargs):
            if self.events is None:
                return method(*args, **kwargs)
            start = time.time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                mb = args[0] if args else next(iter(kwargs.values()))
                if name == "forward_one_chunk":
                    kind = "F"
                elif name == "backward_weight_one_chunk":
                    kind = "W"
                else:
                    kind = "B" if kwargs.get("full_backward", args[2] if len(args) > 2 else True) else "I"
                self.events.append({"kind": kind, "stage": stage.stage_index, "mb": int(mb),
                                    "start_ns": start, "end_ns": time.time_ns()})
        return run

    def begin_step(self, step: int) -> None:
        self.events = [] if step in self.steps else None

    def end_step(self, step: int) -> dict[int, float] | None:
        """Write this rank's actions; the writer merges every rank's. Returns the measured bubble per
        pipeline rank on the writer (None elsewhere, and for steps not recorded)."""
        if self.events is None:
            return None
        events, self.events = self.events, None
        self.folder.mkdir(parents=True, exist_ok=True)
        part = self.folder / f".timeline-step{step}-rank{self.rank}.json"
        part.write_text(json.dumps({"rank": self.rank, "pp_rank": self.pp_rank, "events": events}))
        if dist.is_initialized():
            dist.barrier()
        if not self.writer:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        ranks = []
        for r in range(world):
            path = self.folder / f".timeline-step{step}-rank{r}.json"
            ranks.append(json.loads(path.read_text()))
            path.unlink()
        trace, bubbles = merge_timeline(ranks, step)
        (self.folder / f"pipeline_timeline_step{step}.json").write_text(json.dumps(trace))
        logger.info("pipeline timeline of step %d: %s; measured bubble %s", step,
                    self.folder / f"pipeline_timeline_step{step}.json",
                    ", ".join(f"pp rank {p} {100 * b:.1f}%" for p, b in sorted(bubbles.items())))
        return bubbles


def merge_timeline(ranks: list[dict], step: int) -> tuple[dict, dict[int, float]]:
    """Chrome trace events (one process row per rank, times in microseconds from the step's first
    action) and the measured bubble of each pipeline rank (its idle share of the pipeline span)."""
    starts = [e["start_ns"] for r in ranks for e in r["events"]]
    ends = [e["end_ns"] for r in ranks for e in r["events"]]
    t0, span = min(starts), max(ends) - min(starts)
    events, busy = [], {}
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"],
                       "args": {"name": f"rank {r['rank']} (pp rank {r['pp_rank']})"}})
        for e in sorted(r["events"], key=lambda e: e["start_ns"]):
            events.append({"name": f"{e['stage']}{e['kind']}{e['mb']}", "cat": e["kind"], "ph": "X", "pid": r["rank"],
                           "tid": 0, "ts": (e["start_ns"] - t0) / 1e3, "dur": (e["end_ns"] - e["start_ns"]) / 1e3,
                           "args": {"stage": e["stage"], "microbatch": e["mb"], "action": e["kind"]}})
        # ranks of one pipeline rank (TP/FSDP peers) run the same actions: the first one stands for them
        busy.setdefault(r["pp_rank"], sum(e["end_ns"] - e["start_ns"] for e in r["events"]))
    bubbles = {p: 1 - b / span for p, b in busy.items()}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": step, "span_us": span / 1e3, "bubble": {str(p): b for p, b in bubbles.items()}}}, \
        bubbles
