"""Profiling: torch.profiler traces, CUDA memory snapshots, and measured pipeline timelines.

``StepProfiler`` (``[profiling] enable_profiling``, torchtitan's keys): torch.profiler records the
last ``profiler_active`` steps of every ``profile_freq`` steps (after ``profiler_warmup`` untraced
ones) and writes ``<dump>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json``, a Chrome trace
of that rank's CPU operators (and device kernels on CUDA). With ``enable_memory_snapshot`` on
CUDA, allocations are recorded from the start and a snapshot is dumped every ``profile_freq``
steps to ``<dump>/<save_memory_snapshot_folder>/iteration_<N>/rank<R>_memory_snapshot.pickle``.

Measured pipeline timelines: when each schedule action ran on each rank, as a Chrome/Perfetto trace.

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

import torch
import torch.distributed as dist

from trainer.config.schema import Profiling

logger = logging.getLogger(__name__)

# PipelineStage methods and the action each is; a backward that is not full is the input gradient.
_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StepProfiler:
    """torch.profiler over chosen steps, and CUDA memory snapshots; call ``step(n)`` after each step."""

    def __init__(self, profiling: Profiling, dump_folder: str, *, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = profiling, rank, device
        self.traces = Path(dump_folder) / profiling.save_traces_folder
        self.snapshots = Path(dump_folder) / profiling.save_memory_snapshot_folder
        self.profiler = None
        self.memory = profiling.enable_memory_snapshot and device.type == "cuda"
        if profiling.enable_memory_snapshot and not self.memory:
            logger.warning("[profiling] enable_memory_snapshot needs a CUDA device; ignored on %s", device.type)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if profiling.enable_profiling:
            f, warmup, active = profiling.profile_freq, profiling.profiler_warmup, profiling.profiler_active
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=self._save_trace,
                schedule=torch.profiler.schedule(wait=f - warmup - active, warmup=warmup, active=active),
            )
            self.profiler.start()
            self.step_num = 0

    def _save_trace(self, prof) -> None:
        folder = self.traces / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        # Where the step's time went, without opening the trace: operators by their own time.
        # A diagnostic must not end the run: a failed summary is logged, the trace stays.
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        ops = folder / f"rank{self.rank}_ops.txt"
        try:
            ops.write_text(prof.key_averages().table(sort_by=by, row_limit=30, max_name_column_width=70))
        except Exception as e:  # noqa: BLE001 (anything the summary raises)
            logger.warning("operator summary of step %d not written: %s", self.step_num, e)
            ops = "not written"
        logger.info("profiler trace of step %d: %s (operators by self time: %s)", self.step_num,
                    folder / f"rank{self.rank}_trace.json", ops)

    def step(self, step: int) -> None:
        if self.profiler is not None:
            self.step_num = step
            self.profiler.step()
        if self.memory and step % self.cfg.profile_freq == 0:
            folder = self.snapshots / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False


class PipelineTimeline:
    """Records this rank's pipeline actions for the chosen steps and merges every rank's on one rank."""

    def __init__(self, steps: list[int], folder: Path, *, rank: int, pp_rank: int, writer: bool,
                 schedule: tuple[str, int, int, int] | None = None, sync: bool = False, calibration=None):
        """``schedule`` = (name, pp, microbatches, stages per rank): the simulated timeline drawn next
        to the measured one (None for a CSV schedule: measured only). ``sync`` (CUDA): wait for the
        device around each timed action, so the times are when the kernels ran, not when they were
        queued (only in timed steps). ``calibration`` (a ``pipeline_calibration.Calibration``, on the writer):
        compares each timed step with the plan's prediction and writes the measured costs."""
        self.steps, self.folder = set(steps), Path(folder)
        self.calibration = calibration
        self.rank, self.pp_rank, self.writer = rank, pp_rank, writer
        self.schedule, self.sync = schedule, sync
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
            if self.sync:
                torch.cuda.synchronize()
            start = time.time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
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
        simulated, versus_model = None, ""
        if self.schedule is not None:
            from trainer.parallel.schedule_sim import replayed_span, simulated_spans

            simulated = simulated_spans(*self.schedule)
            actions = [(e["kind"], e["stage"], (e["end_ns"] - e["start_ns"]) / 1e9) for r in ranks for e in r["events"]]
            try:
                model_us = replayed_span(*self.schedule, actions) * 1e6
            except ValueError as e:  # an action kind the trace lacks: a diagnostic must not end the run
                versus_model = f"; no replay with the measured action times ({e})"
            else:
                trace["otherData"]["model_span_us"] = model_us
                versus_model = (f"; span {trace['otherData']['span_us'] / 1e3:.1f} ms against {model_us / 1e3:.1f} ms"
                                " for the schedule replayed with the measured action times and free communication"
                                f" ({trace['otherData']['span_us'] / model_us:.3f}x)")
        (self.folder / f"pipeline_timeline_step{step}.json").write_text(json.dumps(trace))
        (self.folder / f"pipeline_timeline_step{step}.svg").write_text(timeline_svg(trace, simulated, step))
        logger.info("pipeline timeline of step %d: %s (picture %s); measured bubble %s%s", step,
                    self.folder / f"pipeline_timeline_step{step}.json", self.folder / f"pipeline_timeline_step{step}.svg",
                    ", ".join(f"pp rank {p} {100 * b:.1f}%" for p, b in sorted(bubbles.items())), versus_model)
        if self.calibration is not None:
            # the first rank of each pipeline rank stands for its TP/FSDP peers, as in the bubble
            first = {}
            for r in ranks:
                first.setdefault(r["pp_rank"], r)
            own = [(e["kind"], e["stage"], (e["end_ns"] - e["start_ns"]) / 1e9) for r in first.values() for e in r["events"]]
            try:
                logger.info("%s", self.calibration.add(step, own, bubbles, trace["otherData"]["span_us"] / 1e6))
            except Exception as e:  # noqa: BLE001 (a diagnostic must not end the run)
                logger.warning("pipeline costs of step %d not calibrated: %s", step, e)
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


_COLORS = {"F": "#4e79a7", "B": "#e15759", "I": "#f28e2b", "W": "#59a14f"}


def timeline_svg(trace: dict, simulated: list[tuple] | None, step: int) -> str:
    """A picture of the measured timeline (one row per pipeline rank, its first rank standing for its
    TP/FSDP peers) above the simulated one (F = 1, B = 2, I = W = 1, no communication), each
    scaled to its own span. Each box is one action, labelled like a CSV cell (stage, kind, microbatch)."""
    width, row, left, gap = 1000, 22, 70, 36
    rows: dict[int, list[tuple]] = {}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    seen_pp: dict[int, int] = {}
    for pid, name in sorted(names.items()):
        pp_rank = int(name.rsplit("pp rank ", 1)[1].rstrip(")"))
        seen_pp.setdefault(pp_rank, pid)
    for pp_rank, pid in seen_pp.items():
        rows[pp_rank] = [(e["cat"], e["args"]["stage"], e["args"]["microbatch"], e["ts"], e["ts"] + e["dur"])
                         for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
    panels = [(f"measured, step {step} ({trace['otherData']['span_us'] / 1e3:.1f} ms)", rows)]
    if simulated:
        sim_rows: dict[int, list[tuple]] = {}
        for r, kind, stage, mb, start, end in simulated:
            sim_rows.setdefault(r, []).append((kind, stage, mb, start, end))
        panels.append(("simulated (F = 1, B = 2, I = W = 1 unit; no communication)", sim_rows))
    height = sum(gap + row * len(r) for _, r in panels) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + left + 10}" height="{height}"'
           ' font-family="sans-serif" font-size="10">']
    y = 0
    for title, panel in panels:
        out.append(f'<text x="4" y="{y + 24}" font-size="12">{title}</text>')
        y += gap - 6
        end = max((a[4] for acts in panel.values() for a in acts), default=1) or 1
        for r in sorted(panel):
            out.append(f'<text x="4" y="{y + 15}">pp rank {r}</text>')
            for kind, stage, mb, start, stop in panel[r]:
                x, w = left + width * start / end, max(width * (stop - start) / end, 0.5)
                label = f"{stage}{kind}{mb}"
                out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 4}" fill="{_COLORS[kind]}"'
                           f' stroke="white" stroke-width="0.5"><title>{label}</title></rect>')
                if w > 7 * len(label):
                    out.append(f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white">{label}</text>')
            y += row
        y += 6
    out.append("</svg>")
    return "\n".join(out) + "\n"


class SavedActivationMeter:
    """What autograd keeps for backward during one step, in bytes: the live total's peak.

    A saved-tensor hook sees every tensor an operation saves; each storage counts once however
    many operations save it or views of it, from the first save until autograd drops its last
    reference (after the backward that used it). Parameters and buffers (also gathered FSDP
    parameters and their transposed views) are not activations and are left out. Tensors kept
    by activation checkpointing's own frames are invisible to the hook, so under AC this counts
    only what the non-checkpointed code saves. Under autocast (bf16 without FSDP), the low-precision
    copies of the weights that matmuls save are not parameters and are counted (an overcount by up to
    the model's bf16 size); CPU runs in float32 have no such copies.
    """

    def __init__(self, chunks) -> None:
        self._exclude = {_local(t).untyped_storage().data_ptr()
                         for chunk in chunks for t in [*chunk.parameters(), *chunk.buffers()]}
        self._live: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self.current = self.peak = 0

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        local = _local(tensor)
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor
        storage = local.untyped_storage()
        address = storage.data_ptr()
        if address == 0 or address in self._exclude:  # empty, or a parameter/buffer of the model
            return tensor
        entry = self._live.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        # detached: a saved output keeps its grad_fn, which holds this object: a cycle through autograd's
        # C++ graph that no collector sees (seen to keep split-backward schedules' tensors alive)
        return _Held(tensor.detach(), self, address)

    def _release(self, address: int) -> None:
        entry = self._live[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[address]


class _Held:
    """A saved tensor as autograd stores it while metered; dropping it releases its bytes."""

    __slots__ = ("tensor", "meter", "address")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivationMeter, address: int) -> None:
        self.tensor, self.meter, self.address = tensor, meter, address

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __del__(self) -> None:
        self.meter._release(self.address)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the data of a DTensor or another wrapper subclass (e.g. a collective's result)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        tensor = getattr(tensor, tensor.__tensor_flatten__()[0][0])
    return tensor
