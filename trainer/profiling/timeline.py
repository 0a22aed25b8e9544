"""Measured pipeline timelines (``[profiling] pipeline_timeline_steps``): when each compute action and each block
inside it ran on every rank, as a trace, a picture and a bubble per pipeline rank (docs/pipeline.md, "Measured
timeline")."""

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.pipeline.simulate import KIND_NAMES, KINDS, replayed_span

logger = logging.getLogger(__name__)

# PipelineStage methods and the action each is; a backward that is not full is the input gradient.
_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class PipelineTimeline:
    """Records this rank's pipeline actions for the chosen steps and merges every rank's on one rank."""

    def __init__(self, steps: list[int], folder: Path, *, rank: int, pp_rank: int, writer: bool,
                 program=None, sync: bool = False, calibration=None):
        """``program`` (a ``simulate.Program``): replayed with the measured action times and drawn under the measured
        timeline (None: measured only). ``sync`` (CUDA, timed steps only): wait for the device around each timed
        action, so the times are when the kernels ran. ``calibration`` (a ``calibrate.Calibration``, on the writer)."""
        self.steps, self.folder = set(steps), Path(folder)
        self.calibration = calibration
        self.rank, self.pp_rank, self.writer = rank, pp_rank, writer
        self.program, self.sync = program, sync
        self.events: list[dict] | None = None  # recording when not None
        self.current: dict | None = None  # the action running now, in recorded steps
        self.block_counts: dict[int, int] = {}  # stage index -> blocks whose boundaries it marks

    def attach(self, stages, layers_attr: str | None = None, *, compiled: bool = False) -> None:
        """Wrap each stage's compute methods (on the instances: other stages are untouched). With
        ``layers_attr``, each stage's blocks also mark where each of them begins and the last ends, unless the
        blocks are ``compiled`` (their hooks would run inside the compiled code, where clocks are not read)."""
        if layers_attr is not None and compiled:
            logger.info("pipeline timeline: the blocks are compiled, so the stages' parts outside their blocks are"
                        " not timed (the calibration divides each stage's time as the FLOP model does)")
            layers_attr = None
        for stage in stages:
            for name in _METHODS:
                setattr(stage, name, self._timed(stage, name, getattr(stage, name)))
            if layers_attr is not None and hasattr(stage, "submod"):
                from trainer.models.registry import model_blocks

                blocks = list(model_blocks(stage.submod, layers_attr).values())
                if blocks:
                    hook_block_boundaries(blocks, self._timing_forward, self._mark)
                    self.block_counts[stage.stage_index] = len(blocks)

    def _timing_forward(self) -> bool:
        return self.current is not None and self.current["kind"] == "F"

    def _mark(self, boundary: int) -> None:
        """The running action's first crossing of block ``boundary`` (0: before the first block, n: after the
        last; later crossings: a recomputation, or the weight-gradient pass walking the graph again)."""
        if self.current is not None and boundary not in self.current["bounds"]:
            if self.sync:
                torch.cuda.synchronize()
            self.current["bounds"][boundary] = time.time_ns()

    def timed_loss(self, loss_fn):
        """``loss_fn`` whose time, in recorded steps, joins the forward that precedes it (the schedule
        computes each microbatch's loss right after the last stage's forward of it)."""
        def run(*args, **kwargs):
            try:
                return loss_fn(*args, **kwargs)
            finally:
                if self.events and self.events[-1]["kind"] == "F":
                    if self.sync:
                        torch.cuda.synchronize()
                    self.events[-1]["end_ns"] = time.time_ns()
        return run

    def _timed(self, stage, name, method):
        def run(*args, **kwargs):
            if self.events is None:
                return method(*args, **kwargs)
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:
                kind = "B" if kwargs.get("full_backward", args[2] if len(args) > 2 else True) else "I"
            mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
            if self.sync:
                torch.cuda.synchronize()
            self.current = event = {"kind": kind, "stage": stage.stage_index, "mb": int(mb), "bounds": {},
                                    "blocks": self.block_counts.get(stage.stage_index, 0), "start_ns": time.time_ns()}
            try:
                return method(*args, **kwargs)
            finally:
                self.current = None
                if self.sync:
                    torch.cuda.synchronize()
                event["end_ns"] = time.time_ns()
                self.events.append(event)
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
        if self.program is not None:
            actions = [(e["kind"], e["stage"], (e["end_ns"] - e["start_ns"]) / 1e9) for r in ranks for e in r["events"]]
            spans: list[tuple] = []
            try:
                model_us = replayed_span(self.program, actions, spans) * 1e6
            except ValueError as e:  # an action kind the trace lacks: a diagnostic must not end the run
                versus_model = f"; no replay with the measured action times ({e})"
            else:
                simulated = [(r, kind, stage, mb, start * 1e6, end * 1e6) for r, kind, stage, mb, start, end in spans]
                trace["otherData"]["model_span_us"] = model_us
                versus_model = (f"; span {trace['otherData']['span_us'] / 1e3:.1f} ms against {model_us / 1e3:.1f} ms"
                                " for the schedule replayed with the measured action times and free communication"
                                f" ({trace['otherData']['span_us'] / model_us:.3f}x)")
        (self.folder / f"pipeline_timeline_step{step}.json").write_text(json.dumps(trace))
        (self.folder / f"pipeline_timeline_step{step}.svg").write_text(timeline_svg(trace, simulated, step))
        logger.info("pipeline timeline of step %d: %s (picture %s); measured bubble %s%s", step,
                    self.folder / f"pipeline_timeline_step{step}.json",
                    self.folder / f"pipeline_timeline_step{step}.svg",
                    ", ".join(f"pp rank {p} {100 * b:.1f}%" for p, b in sorted(bubbles.items())), versus_model)
        if self.calibration is not None:
            # the first rank of each pipeline rank stands for its TP/FSDP peers, as in the bubble
            first = {}
            for r in ranks:
                first.setdefault(r["pp_rank"], r)
            own = [(e["kind"], e["stage"], (e["end_ns"] - e["start_ns"]) / 1e9)
                   for r in first.values() for e in r["events"]]
            parts = [(e["kind"], e["stage"], part, sum(seconds) if part == "blocks" else seconds)
                     for r in first.values() for e in r["events"] for part, seconds in part_seconds(e).items()]
            try:
                logger.info("%s", self.calibration.add(step, own, bubbles, trace["otherData"]["span_us"] / 1e6,
                                                       parts))
            except Exception as e:  # noqa: BLE001 (a diagnostic must not end the run)
                logger.warning("pipeline costs of step %d not calibrated: %s", step, e)
        return bubbles


def hook_block_boundaries(blocks: list, timing: Callable[[], bool], mark: Callable[[int], None],
                          first_input: Callable[[torch.Tensor], None] | None = None) -> list:
    """Call ``mark(i)`` when a forward, while ``timing()``, crosses block boundary ``i`` (0: before the first
    block, ``len(blocks)``: after the last) and again when the backward's gradient reaches it; ``first_input``
    receives the first block's hidden input in those forwards. Returns the hooks' handles."""

    def crossed(boundary: int, hidden) -> None:
        mark(boundary)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            if boundary == 0 and first_input is not None:
                first_input(hidden)
            hidden.register_hook(lambda grad: mark(boundary))

    def starts(index: int):
        def hook(module, args) -> None:
            # the hidden state: the first input that carries a gradient (a traced block takes the rotary
            # table first); its gradient is ready when the backward has passed this block
            if timing():
                crossed(index, next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None))
        return hook

    def ends(module, args, output) -> None:
        if timing():
            crossed(len(blocks), output)

    handles = [block.register_forward_pre_hook(starts(i)) for i, block in enumerate(blocks)]
    return handles + [blocks[-1].register_forward_hook(ends)]


def part_seconds(event: dict) -> dict:
    """Where an action's time went, from the marks its blocks left: {"lead": seconds before its first block, "tail":
    after its last (a backward runs the tail first), "blocks": each block's seconds}, parts whose marks are missing
    left out. A weight gradient is not divided (one pass), except the first stage's, its whole backward."""
    n = event.get("blocks", 0)
    bounds = {int(i): t for i, t in event.get("bounds", {}).items()}  # JSON keys are strings
    if not n or (event["kind"] == "W" and event["stage"] != 0):
        return {}
    out, start, end = {}, event["start_ns"], event["end_ns"]
    forward = event["kind"] == "F"
    if 0 in bounds:
        out["lead"] = ((bounds[0] - start) if forward else (end - bounds[0])) / 1e9
    if n in bounds:
        out["tail"] = ((end - bounds[n]) if forward else (bounds[n] - start)) / 1e9
    if all(i in bounds for i in range(n + 1)):
        out["blocks"] = [abs(bounds[i + 1] - bounds[i]) / 1e9 for i in range(n)]
    return out


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
                           "args": {"stage": e["stage"], "microbatch": e["mb"], "action": e["kind"],
                                    **{f"{part}_ms": (seconds * 1e3 if part != "blocks" else [x * 1e3 for x in seconds])
                                       for part, seconds in part_seconds(e).items()}}})
        # ranks of one pipeline rank (TP/FSDP peers) run the same actions: the first one stands for them
        busy.setdefault(r["pp_rank"], sum(e["end_ns"] - e["start_ns"] for e in r["events"]))
    bubbles = {p: 1 - b / span for p, b in busy.items()}
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"step": step, "span_us": span / 1e3, "bubble": {str(p): b for p, b in bubbles.items()}}}
    return trace, bubbles


_COLORS = dict(zip(KINDS, ("#4e79a7", "#e15759", "#f28e2b", "#59a14f")))


def timeline_svg(trace: dict, simulated: list[tuple] | None, step: int) -> str:
    """A picture of the measured timeline (one row per pipeline rank) above the simulated one ((pp rank, kind, stage,
    microbatch, start, end), microseconds) on one time scale, each row's bubble beside it (docs/pipeline.md)."""
    from xml.sax.saxutils import escape

    width, row, left, right = 1000, 22, 70, 90
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    first: dict[int, int] = {}
    for pid, name in sorted(names.items()):
        first.setdefault(int(name.rsplit("pp rank ", 1)[1].rstrip(")")), pid)
    rows = {p: [(e["cat"], e["args"]["stage"], e["args"]["microbatch"], e["ts"], e["ts"] + e["dur"])
                for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid] for p, pid in first.items()}
    # (title, rows, t0, span in us): the measured span is merge_timeline's, over every rank, TP/FSDP peers too
    panels = [(f"measured, step {step}", rows, 0.0, trace["otherData"]["span_us"])]
    if simulated:
        sim_rows: dict[int, list[tuple]] = {}
        for p, kind, stage, mb, start, end in simulated:
            sim_rows.setdefault(p, []).append((kind, stage, mb, start, end))
        t0 = min(s[4] for s in simulated)
        panels.append(("schedule replayed with the measured action times, free communication", sim_rows, t0,
                       max(s[5] for s in simulated) - t0))
    longest = max(span for *_, span in panels)
    scale = width / longest  # px per us, shared by the panels
    # ms: the smallest of 1, 2, 5 x 10^k above a tenth of the span, so that 5 to 10 ticks fall within it
    tick = min(m * 10.0 ** k for k in range(-6, 12) for m in (1, 2, 5) if m * 10.0 ** k > longest / 1e3 / 10)

    out = ['<g id="legend">']
    x = left
    for kind, color in _COLORS.items():
        text = f"{kind} {KIND_NAMES[kind]}"
        out.append(f'<rect x="{x}" y="8" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="17">{text}</text>')
        x += 24 + 6 * len(text)
    out.append("</g>")
    y = 24
    for title, panel, t0, span in panels:
        out.append(f'<text x="4" y="{y + 16}" font-size="12">{escape(title)} ({span / 1e3:.1f} ms)</text>')
        y += 24
        for p in sorted(panel):
            out.append(f'<text x="4" y="{y + 15}">pp rank {p}</text>')
            for kind, stage, mb, start, stop in panel[p]:
                x, w = left + scale * (start - t0), max(scale * (stop - start), 0.5)
                label = f"{stage}{kind}{mb}"
                out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 4}" fill="{_COLORS[kind]}"'
                           f' stroke="white" stroke-width="0.5"><title>{label}</title></rect>')
                if w > 7 * len(label):
                    out.append(f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white">{label}</text>')
            # per-rank busy time summed as merge_timeline does (one rank's actions do not overlap)
            bubble = 1 - sum(a[4] - a[3] for a in panel[p]) / span
            out.append(f'<text x="{left + width + 8}" y="{y + 15}">bubble {100 * bubble:.1f}%</text>')
            y += row
        out.append(f'<g class="axis"><line x1="{left}" y1="{y + 2}" x2="{left + width}" y2="{y + 2}" stroke="black"/>')
        for i in range(int(longest / 1e3 / tick + 1e-9) + 1):  # a tick at the span end despite rounding
            x = left + scale * i * tick * 1e3
            out.append(f'<line x1="{x:.1f}" y1="{y + 2}" x2="{x:.1f}" y2="{y + 6}" stroke="black"/>'
                       f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{round(i * tick, 9):g}</text>')
        out.append(f'<text x="{left + width + 8}" y="{y + 16}">ms</text></g>')
        y += 30
    total_width, height = left + width + right, y
    return "\n".join([f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_width}" height="{height}"'
                      ' font-family="sans-serif" font-size="10">',
                      f'<rect x="0" y="0" width="{total_width}" height="{height}" fill="white"/>',
                      *out, "</svg>"]) + "\n"
