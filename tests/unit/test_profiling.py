"""Pipeline timelines: what is recorded per action, how ranks are merged, the measured bubble."""

import json
import math
import re
import time

import pytest
import torch
from torch import nn

from trainer.profiling import PipelineTimeline, merge_timeline, timeline_svg


class FakeStage:
    stage_index = 3

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        return "out"

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return None

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return None


def test_each_action_is_recorded_with_its_kind_stage_and_microbatch(tmp_path):
    stage = FakeStage()
    timeline = PipelineTimeline([2], tmp_path, rank=0, pp_rank=0, writer=True)
    timeline.attach([stage])
    timeline.begin_step(1)  # not a chosen step: nothing recorded
    assert stage.forward_one_chunk(0, ()) == "out"
    assert timeline.end_step(1) is None and not list(tmp_path.iterdir())
    timeline.begin_step(2)
    stage.forward_one_chunk(5, ())
    stage.backward_one_chunk(5, full_backward=False)  # as zero-bubble schedules call it: the input gradient
    stage.backward_weight_one_chunk(5)
    stage.backward_one_chunk(4, None, True)  # a full backward, positional
    bubbles = timeline.end_step(2)
    trace = json.loads((tmp_path / "pipeline_timeline_step2.json").read_text())
    actions = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert actions == ["3F5", "3I5", "3W5", "3B4"]
    assert set(bubbles) == {0} and 0 <= bubbles[0] < 1
    # the merged trace and its picture; the ranks' parts are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline_timeline_step2.json", "pipeline_timeline_step2.svg"]


def test_merge_places_ranks_on_one_clock_and_measures_each_pipeline_ranks_bubble():
    def ev(kind, start, end, stage=0, mb=0):
        return {"kind": kind, "stage": stage, "mb": mb, "start_ns": start, "end_ns": end}

    ranks = [
        {"rank": 0, "pp_rank": 0, "events": [ev("F", 1000, 11000), ev("B", 21000, 31000)]},
        {"rank": 1, "pp_rank": 1, "events": [ev("F", 11000, 16000, stage=1), ev("B", 16000, 21000, stage=1)]},
        {"rank": 2, "pp_rank": 1, "events": [ev("F", 11000, 12000, stage=1)]},  # a TP peer of rank 1: not counted
    ]
    trace, bubbles = merge_timeline(ranks, step=7)
    # span 1000..31000 ns = 30 us; rank 0 busy 20 us, pp rank 1 (rank 1) busy 10 us
    assert bubbles == pytest.approx({0: 1 / 3, 1: 2 / 3})
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in x[:3]] == [
        (0, "0F0", 0.0, 10.0), (0, "0B0", 20.0, 10.0), (1, "1F0", 10.0, 5.0)]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0 (pp rank 0)", 1: "rank 1 (pp rank 1)", 2: "rank 2 (pp rank 1)"}
    assert trace["otherData"]["step"] == 7 and trace["otherData"]["span_us"] == 30.0


def test_torch_profiler_traces_the_chosen_steps_of_a_run(tmp_path):
    from tests.distributed.harness import PARITY
    from trainer.config import load_config
    from trainer.train import main

    main(load_config(overrides=[*PARITY, "--training.steps", "4", "--training.local_batch_size", "8",
                                "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                                "--profiling.profiler_warmup", "0", "--job.dump_folder", str(tmp_path)]))
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]  # the last step of each 2
    events = json.loads((traces / "iteration_4" / "rank0_trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("ProfilerStep#") for n in names) and "aten::mm" in names
    # the operator summary beside it, by self time, lists the linear layers' matmuls (which operator leads is a
    # timing: on this tiny model aten::to, aten::mm and attention trade places from run to run)
    ops = (traces / "iteration_4" / "rank0_ops.txt").read_text().splitlines()
    assert "aten::mm" in {line.split()[0] for line in ops if line.strip().startswith("aten::")}
    # rows in order of self time: the device's (Self CUDA %) where there is one, else the CPU's (Self CPU %)
    header = next(line for line in ops if line.lstrip().startswith("Name"))
    pct_columns = [c for c in re.split(r"\s{2,}", header.strip()) if c.endswith("%")]
    key = next((c for c in pct_columns if c.startswith("Self") and "CPU" not in c), "Self CPU %")
    column = pct_columns.index(key)
    self_pct = [float([w for w in line.split() if w.endswith("%")][column][:-1]) for line in ops if "%" in line
                and not line.lstrip().startswith("Name")]
    assert len(self_pct) >= 10 and self_pct == sorted(self_pct, reverse=True)


def test_a_failed_operator_summary_does_not_end_the_run(tmp_path, monkeypatch, caplog):
    from torch.autograd.profiler_util import EventList

    from tests.distributed.harness import PARITY
    from trainer.config import load_config
    from trainer.train import main

    def broken(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(EventList, "table", broken)
    result = main(load_config(overrides=[*PARITY, "--training.steps", "2", "--profiling.enable_profiling",
                                         "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0",
                                         "--job.dump_folder", str(tmp_path)]))
    assert len(result.step_times) == 2
    folder = tmp_path / "profile_traces" / "iteration_2"
    assert (folder / "rank0_trace.json").exists() and not (folder / "rank0_ops.txt").exists()
    assert "operator summary of step 2 not written: no space left on device" in caplog.text


def test_profiler_window_must_fit_its_period():
    from trainer.config import load_config
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"profiler_warmup=2 \+ profiler_active=1 must fit in profile_freq=2 steps"):
        load_config(overrides=["--profiling.enable_profiling", "--profiling.profile_freq", "2",
                               "--profiling.profiler_warmup", "2"])


@pytest.mark.parametrize("schedule, pp, m, per_rank", [("GPipe", 2, 8, 1), ("1F1B", 4, 8, 1), ("1F1B", 2, 3, 1),
                                                       ("Interleaved1F1B", 2, 8, 2), ("ZBVZeroBubble", 4, 8, 2)])
def test_simulated_spans_give_the_expected_bubble(schedule, pp, m, per_rank):
    """The drawn simulation is the one the bubble comes from; for one stage per rank it is built
    here (torch's action lists for those are not usable), so check it against fill-and-drain."""
    from trainer.pipeline.simulate import bubble_fraction, simulated_spans

    spans = simulated_spans(schedule, pp, m, per_rank)
    assert len(spans) == pp * per_rank * m * (3 if schedule == "ZBVZeroBubble" else 2)
    makespan = max(s[5] for s in spans)
    busy = sum(s[5] - s[4] for s in spans)
    expected = (pp - 1) / (m + pp - 1) if per_rank == 1 else bubble_fraction(schedule, pp, m, per_rank)
    assert 1 - busy / (pp * makespan) == pytest.approx(expected)


SVG = "{http://www.w3.org/2000/svg}"


def action(kind, stage, mb, start, end):
    """One recorded action, times in ns."""
    return {"kind": kind, "stage": stage, "mb": mb, "start_ns": start, "end_ns": end}


def picture(trace, simulated):
    import xml.etree.ElementTree as ET

    return ET.fromstring(timeline_svg(trace, simulated, step=1))


def action_boxes(svg):
    """(label, x, width) of each action's box, in drawing order: the measured panel's, then the simulated's."""
    return [(r.find(f"{SVG}title").text, float(r.get("x")), float(r.get("width")))
            for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


# 1F1B, 2 ranks, 1 microbatch, in ns: F 10 us and B 20 us on stage 0, F and B 10 us on stage 1, with 2 us
# transfers between the ranks; rank 2 is a TP peer of rank 1 whose backward ends last (at 56 us).
MEASURED = [
    {"rank": 0, "pp_rank": 0, "events": [action("F", 0, 0, 0, 10_000), action("B", 0, 0, 34_000, 54_000)]},
    {"rank": 1, "pp_rank": 1, "events": [action("F", 1, 0, 12_000, 22_000), action("B", 1, 0, 22_000, 32_000)]},
    {"rank": 2, "pp_rank": 1, "events": [action("F", 1, 0, 12_000, 22_000), action("B", 1, 0, 24_000, 56_000)]},
]
# the same actions replayed without transfers, in us: span 50
REPLAYED = [(0, "F", 0, 0, 0.0, 10.0), (1, "F", 1, 0, 10.0, 20.0), (1, "B", 1, 0, 20.0, 30.0),
            (0, "B", 0, 0, 30.0, 50.0)]


def test_timeline_picture_has_a_box_per_action_measured_and_simulated():
    from trainer.pipeline.simulate import simulated_spans

    trace, _ = merge_timeline(MEASURED, step=1)
    in_us = [(r, kind, stage, mb, 10 * start, 10 * end)
             for r, kind, stage, mb, start, end in simulated_spans("1F1B", 2, 1, 1)]
    boxes = [label for label, *_ in action_boxes(picture(trace, in_us))]
    assert boxes == ["0F0", "0B0", "1F0", "1B0"] * 2  # measured (rank 2 drawn as its pp rank's rank 1), simulated


def test_timeline_panels_share_one_time_scale():
    """The measured span (56 us) is longer than the replayed one (50 us); an action takes as many pixels in both."""
    trace, _ = merge_timeline(MEASURED, step=1)
    boxes = action_boxes(picture(trace, REPLAYED))
    measured, replayed = dict((b[0], b[2]) for b in boxes[:4]), dict((b[0], b[2]) for b in boxes[4:])
    assert measured == replayed
    assert measured["0B0"] == pytest.approx(2 * measured["0F0"], abs=0.1)  # 20 us against 10 us


def test_timeline_rows_show_their_bubble():
    trace, bubbles = merge_timeline(MEASURED, step=1)
    texts = list(picture(trace, REPLAYED).iter(f"{SVG}text"))
    row_names = {t.get("y"): t.text for t in texts if t.text.startswith("pp rank")}
    shown = [(row_names[t.get("y")], t.text) for t in texts if t.text.startswith("bubble")]
    # measured: the span runs to the TP peer's end, 56 us; pp rank 0 is busy 10 + 20 us, pp rank 1 (rank 1) 10 + 10 us
    # replayed: span 50 us, the same busy times
    expected = [(0, 30, 56), (1, 20, 56), (0, 30, 50), (1, 20, 50)]  # (pp rank, busy, span) in us
    assert shown == [(f"pp rank {p}", f"bubble {100 * (1 - busy / span):.1f}%") for p, busy, span in expected]
    assert [text for _, text in shown[:2]] == [f"bubble {100 * bubbles[p]:.1f}%" for p in (0, 1)]  # merge_timeline's


def test_timeline_legend_names_each_action_kind_in_its_box_colour():
    trace, _ = merge_timeline(MEASURED, step=1)
    split = [(0, "F", 0, 0, 0.0, 10.0), (0, "I", 0, 0, 10.0, 15.0), (0, "W", 0, 0, 15.0, 20.0),
             (0, "B", 0, 1, 20.0, 40.0)]
    svg = picture(trace, split)
    legend = svg.find(f"{SVG}g[@id='legend']")
    entries = {t.text: r.get("fill") for r, t in zip(legend.iter(f"{SVG}rect"), legend.iter(f"{SVG}text"))}
    assert set(entries) == {"F forward", "B full backward", "I input gradient", "W weight gradient"}
    box_fill = {r.find(f"{SVG}title").text[1]: r.get("fill") for r in svg.iter(f"{SVG}rect")
                if r.find(f"{SVG}title") is not None}
    assert {text[0]: fill for text, fill in entries.items()} == box_fill and len(set(box_fill.values())) == 4


def test_timeline_picture_has_an_opaque_background():
    trace, _ = merge_timeline(MEASURED, step=1)
    svg = picture(trace, REPLAYED)
    background = svg[0]  # drawn first, under everything else
    assert background.tag == f"{SVG}rect" and background.get("fill") == "white"
    assert float(background.get("x", 0)) == float(background.get("y", 0)) == 0
    assert (background.get("width"), background.get("height")) == (svg.get("width"), svg.get("height"))


@pytest.mark.parametrize("measured_us, replayed_us", [(56, None), (23_000, None), (1_234_000, 2_000_000), (900, 40)])
def test_timeline_axes_tick_round_milliseconds_over_the_longer_span(measured_us, replayed_us):
    trace, _ = merge_timeline([{"rank": 0, "pp_rank": 0, "events": [action("F", 0, 0, 0, 1000 * measured_us)]}], step=1)
    replayed = [(0, "F", 0, 0, 0.0, float(replayed_us))] if replayed_us else None
    svg = picture(trace, replayed)
    longest_ms = max(measured_us, replayed_us or 0) / 1e3
    axes = svg.findall(f".//{SVG}g[@class='axis']")
    assert len(axes) == (2 if replayed else 1)
    box_x, box_width = action_boxes(svg)[0][1:]
    for axis in axes:
        texts = axis.findall(f"{SVG}text")
        assert texts[-1].text == "ms"
        ticks = [(float(t.text), float(t.get("x"))) for t in texts[:-1]]
        step = ticks[1][0] - ticks[0][0]
        mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
        assert ticks[0][0] == 0 and min(abs(mantissa - m) for m in (1, 2, 5)) < 1e-6 and 5 <= len(ticks) <= 10
        assert [v for v, _ in ticks] == pytest.approx([i * step for i in range(len(ticks))])
        assert ticks[-1][0] <= longest_ms * (1 + 1e-9) < ticks[-1][0] + step  # to the end of the longer span
        # the axis measures the boxes: the measured action [0, measured_us] spans its ticks' pixels
        px_per_ms = (ticks[-1][1] - ticks[0][1]) / ticks[-1][0]
        assert box_x == pytest.approx(ticks[0][1], abs=0.1)
        assert box_width == pytest.approx(px_per_ms * measured_us / 1e3, abs=0.2)


def test_replay_with_measured_action_times_follows_the_schedule_order():
    """1F1B on 2 ranks, 2 microbatches, stage 0 F=1 B=2, stage 1 F=3 B=6 (by hand):
    rank 0 runs F0 [0,1], F1 [1,2], then waits for stage 1's backward of mb 0; rank 1 runs
    F0 [1,4], B0 [4,10], F1 [10,13], B1 [13,19]; rank 0's B0 [10,12] and B1 [19,21]: span 21."""
    from trainer.pipeline.simulate import program_for, replayed_span

    one_f_one_b = lambda m: program_for("1F1B", 2, m, 1)  # noqa: E731
    measured = [("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 3.0), ("B", 1, 6.0)]
    spans = []
    assert replayed_span(one_f_one_b(2), measured, spans) == pytest.approx(21.0)
    rank0 = [(kind, mb, start, end) for r, kind, stage, mb, start, end in spans if r == 0]
    assert rank0 == [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 10.0, 12.0), ("B", 1, 19.0, 21.0)]
    # each (kind, stage) takes the median of its samples; a split backward stands in for a full one
    noisy = [("F", 0, 1.0), ("F", 0, 50.0), ("F", 0, 1.0), ("B", 0, 2.0), ("F", 1, 3.0), ("I", 1, 4.0), ("W", 1, 2.0)]
    assert replayed_span(one_f_one_b(2), noisy) == pytest.approx(21.0)
    # equal stages with B = 2F reproduce the unit simulation's fill-and-drain: (m + p - 1) (F + B)
    equal = [(k, s, t) for s in range(2) for k, t in (("F", 0.5), ("B", 1.0))]
    assert replayed_span(one_f_one_b(4), equal) == pytest.approx((4 + 2 - 1) * 1.5)
    with pytest.raises(ValueError, match="no measured F action of stage 1"):
        replayed_span(one_f_one_b(2), [("F", 0, 1.0), ("B", 0, 2.0), ("B", 1, 1.0)])


def test_a_trace_the_replay_cannot_use_is_still_written(tmp_path):
    """Only stage 0 recorded (e.g. a rank's events missing): the replay needs stage 1's actions, so the
    timeline is written without a model span instead of ending the run."""
    stage = FakeStage()
    stage.stage_index = 0
    from trainer.pipeline.simulate import program_for

    timeline = PipelineTimeline([1], tmp_path, rank=0, pp_rank=0, writer=True, program=program_for("1F1B", 2, 2, 1))
    timeline.attach([stage])
    timeline.begin_step(1)
    stage.forward_one_chunk(0, ())
    assert timeline.end_step(1) == {0: 0.0}
    assert "model_span_us" not in json.loads((tmp_path / "pipeline_timeline_step1.json").read_text())["otherData"]


def test_the_loss_after_the_last_stages_forward_is_timed_as_part_of_it(tmp_path):
    """torch computes each microbatch's loss right after the last stage's forward: its time is that
    forward's, not idle time counted as bubble."""
    import time

    class Schedule:
        def _loss_fn(self, output, target):
            time.sleep(0.06)
            return 0.0

    from trainer.pipeline.runtime import wrap_schedule_loss

    stage, schedule = FakeStage(), Schedule()
    timeline = PipelineTimeline([1], tmp_path, rank=0, pp_rank=0, writer=True)
    timeline.attach([stage])
    wrap_schedule_loss(schedule, timeline.timed_loss)
    schedule._loss_fn("out", None)  # outside a recorded step: nothing to extend
    timeline.begin_step(1)
    stage.forward_one_chunk(0, ())
    schedule._loss_fn("out", None)
    stage.backward_one_chunk(0)
    timeline.end_step(1)
    trace = json.loads((tmp_path / "pipeline_timeline_step1.json").read_text())
    f, b = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert f["name"] == "3F0" and f["dur"] >= 60_000  # microseconds: the 60 ms loss is inside the forward
    assert b["ts"] >= f["ts"] + f["dur"] and b["dur"] < 60_000  # an empty backward: wide of a busy machine's pauses


# A stage holding the embedding, two blocks and the output, each part sleeping a known time in its forward
# and its backward (seconds).


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd)
        return grad, None, None


class Part(nn.Module):
    def __init__(self, fwd, bwd):
        super().__init__()
        self.fwd, self.bwd, self.w = fwd, bwd, nn.Parameter(torch.ones(2))

    def forward(self, *args):
        return Sleep.apply(args[-1] * self.w, self.fwd, self.bwd)


class Chunk(nn.Module):
    def __init__(self, traced: bool = False):
        super().__init__()
        self.tok, self.out = Part(0.04, 0.05), Part(0.03, 0.06)
        self.layers = nn.ModuleDict({"0": Part(0.06, 0.09), "1": Part(0.08, 0.07)})
        self.traced = traced

    def forward(self, x):
        h = self.tok(x)
        for block in self.layers.values():
            # a traced stage calls its blocks with the rotary table (no gradient) before the hidden state
            h = block(torch.ones(2), h) if self.traced else block(h)
        return self.out(h)


class Stage(FakeStage):
    stage_index = 0

    def __init__(self, traced: bool = False):
        self.submod = Chunk(traced)

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.output = self.submod(torch.ones(2))
        return self.output

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.output.sum().backward()


@pytest.mark.parametrize("traced", [False, True], ids=["manual", "traced"])
def test_each_action_is_timed_before_in_and_after_its_blocks(tmp_path, traced):
    """A stage holding the embedding, two blocks and the output, each part sleeping a known time in its
    forward and its backward: the trace and the calibration receive the lead (before the first block),
    the tail (after the last) and each block's time, each at least its sleep and less than its sleep plus
    the shortest sleep of any part (what a misplaced mark would add or take away; also when the blocks take
    another tensor before the hidden state, as traced blocks do). A busy machine only ever adds time, so
    each part's least time over three recorded steps is checked."""
    class Calibration:
        def __init__(self):
            self.parts = {}  # (kind, part): seconds per recorded step

        def add(self, step, actions, bubbles, span, parts=()):
            for kind, _, part, seconds in parts:
                self.parts.setdefault((kind, part), []).append(seconds)
            return "calibrated"

    steps = [1, 2, 3]
    stage, calibration = Stage(traced), Calibration()
    timeline = PipelineTimeline(steps, tmp_path, rank=0, pp_rank=0, writer=True, calibration=calibration)
    timeline.attach([stage], "layers")
    stage.forward_one_chunk(0, ())  # outside a recorded step: no marks
    stage.backward_one_chunk(0)
    for step in steps:
        timeline.begin_step(step)
        stage.forward_one_chunk(0, ())
        stage.backward_one_chunk(0)
        timeline.end_step(step)
    sleeps = {("F", "lead"): 0.04, ("F", "tail"): 0.03, ("B", "lead"): 0.05, ("B", "tail"): 0.06}
    blocks = {"F": [0.06, 0.08], "B": [0.09, 0.07]}
    margin = min([*sleeps.values(), *blocks["F"], *blocks["B"]])
    assert set(calibration.parts) == set(sleeps) | {("F", "blocks"), ("B", "blocks")}
    assert all(len(v) == len(steps) for v in calibration.parts.values())
    for key, sleep in sleeps.items():
        assert sleep <= min(calibration.parts[key]) < sleep + margin, (key, calibration.parts[key])
    got = {}  # (kind, part): the part's times over the steps' traces, seconds
    for step in steps:
        trace = json.loads((tmp_path / f"pipeline_timeline_step{step}.json").read_text())
        for e in (e for e in trace["traceEvents"] if e["ph"] == "X"):
            kind, args = e["cat"], e["args"]
            assert len(args["blocks_ms"]) == 2
            for part in ("lead", "tail"):
                got.setdefault((kind, part), []).append(args[f"{part}_ms"] / 1e3)
            for i, ms in enumerate(args["blocks_ms"]):
                got.setdefault((kind, i), []).append(ms / 1e3)
            assert calibration.parts[(kind, "blocks")][step - 1] == pytest.approx(sum(args["blocks_ms"]) / 1e3)
    for (kind, part), times in got.items():
        sleep = blocks[kind][part] if isinstance(part, int) else sleeps[(kind, part)]
        assert len(times) == len(steps) and sleep <= min(times) < sleep + margin, (kind, part, times)


def test_compiled_blocks_are_not_hooked_and_the_run_says_so(tmp_path, caplog):
    """A compiled block would run the boundary hooks inside compiled code: none is registered, one line says so."""
    stage = Stage()
    timeline = PipelineTimeline([1], tmp_path, rank=0, pp_rank=0, writer=True)
    with caplog.at_level("INFO"):
        timeline.attach([stage], "layers", compiled=True)
    blocks = list(stage.submod.layers.values())
    assert not blocks[0]._forward_pre_hooks and not blocks[-1]._forward_hooks
    assert "the blocks are compiled, so the stages' parts outside their blocks are not timed" in caplog.text
