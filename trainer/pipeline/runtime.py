"""Pipeline parallelism at run time: model chunks, PipelineStages and the schedule.

Two front-ends cut the model (``[parallelism] pipeline_parallel_frontend``):
- manual: a chunk is the family's model class built whole on the meta device with the parts its
  stage does not own removed;
- tracer: torch's ``pipeline()`` traces the whole model's forward (torch.export) and splits the
  graph before each split point; a chunk is the traced submodule of its stage.
Either way parameter names are those of the whole model.
"""

import functools
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config.schedules import SCHEDULES
from trainer.errors import ConfigError
from trainer.models import ModelSpec
from trainer.models.registry import model_blocks
from trainer.pipeline.split import PipelinePlan, Stage

if TYPE_CHECKING:  # torch.distributed.pipelining imports torch._dynamo (~0.5 s): only jobs with pp > 1 pay it
    from torch.distributed.pipelining.schedules import _PipelineSchedule

logger = logging.getLogger(__name__)


def build_chunk(make_model: Callable[[], nn.Module], spec: ModelSpec, stage: Stage) -> nn.Module:
    """The model with only ``stage``'s modules left (built on the meta device by ``make_model``)."""
    chunk = make_model()
    if not stage.first:
        for name in spec.pre_layers:
            setattr(chunk, name, None)
    if not stage.last:
        for name in spec.post_layers:
            setattr(chunk, name, None)
    layers = getattr(chunk, spec.layers_attr)
    for key in list(layers.keys()):
        if key not in stage.blocks:
            del layers[key]
    return chunk


TRACER_KEY = '[parallelism] pipeline_parallel_frontend = "tracer"'


def trace_pipeline(model: nn.Module, plan: PipelinePlan, example: torch.Tensor, example_kwargs: dict | None = None):
    """torch's ``Pipe`` of ``model`` (whole, initialised) split before each of ``plan``'s split points.

    ``example`` is one microbatch of inputs (``example_kwargs`` its keyword inputs, e.g. positions): the traced
    graph, and the stages' receive buffers, have its shape. A model torch.export cannot trace (e.g.
    data-dependent shapes) stops with one line.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    points = plan.split_points()
    # The graph is traced in training mode and does not change with eval(): modules that behave
    # differently in evaluation would keep their training behaviour there.
    modal = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)
                    or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)})
    if modal:
        raise ConfigError(f"{TRACER_KEY}: the model has {', '.join(modal)}, which a traced graph would keep in"
                          " training mode during evaluation; use the manual front-end")
    # Each stage ends after its last block (rather than the next one beginning before its first): what the forward
    # computes between two blocks for the later one (a traced family's per-block rotary table and mask) then
    # belongs to the later block's stage.
    ends = {f"{plan.blocks_attr}.{plan.stages[s].blocks[-1]}": SplitPoint.END for s in range(plan.num_stages - 1)}
    try:
        pipe = pipeline(model, mb_args=(example,), mb_kwargs=example_kwargs or None, split_spec=ends)
    except Exception as e:  # torch wraps torch.export's error; its first line names the construct
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise ConfigError(f"{TRACER_KEY}: torch could not trace the model: {type(cause).__name__}: {first}") from None
    if pipe.num_stages != plan.num_stages:
        raise ConfigError(f"{TRACER_KEY}: tracing split the model into {pipe.num_stages} stages, not"
                          f" {plan.num_stages} (split points {points} must each start a module the forward calls)")
    for stage in plan.stages:  # the graph was cut where the plan (and the dry run) says
        got = tuple(model_blocks(pipe.get_stage_module(stage.index), plan.blocks_attr))
        if got != stage.blocks:
            raise ConfigError(f"{TRACER_KEY}: tracing put blocks {list(got)} in stage {stage.index}, not the"
                              f" planned {list(stage.blocks)}; does the forward call the blocks of {plan.blocks_attr}"
                              " in order?")
    # Traced modules hold every buffer as persistent: keep the model's non-persistent ones (e.g. the
    # rotary table) out of the stages' state dicts, so checkpoints have the same keys as a manual run's.
    transient = {f"{owner}.{b}".lstrip(".") for owner, m in model.named_modules()
                 for b in m._non_persistent_buffers_set}
    for i in range(pipe.num_stages):
        stage = pipe.get_stage_module(i)
        for name, _ in stage.named_buffers():
            if name in transient:
                owner, _, attr = name.rpartition(".")
                stage.get_submodule(owner)._non_persistent_buffers_set.add(attr)
    return pipe


@functools.cache
def _warm_up_other_ranks_only(base: type) -> type:
    """``base`` (a torch stage class) whose first-step link warm-up leaves out the neighbour stages on this very rank
    (V placement: stages 1 and 2 on rank 1). gloo cannot send to its own rank, and such stages hand over in memory.
    torch 2.11 warms up every stage this way; torch 2.13 still does for traced stages, while its PipelineStage
    takes a path of its own (a vote over the neighbours) that never calls this."""

    class WarmsUpOtherRanksOnly(base):
        def _get_init_p2p_neighbors_ops(self) -> list:
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    return WarmsUpOtherRanksOnly


@functools.cache
def _traced_stage_class(base: type) -> type:
    """``base`` (a traced stage class) whose stages after the first ignore the step's keyword inputs (positions):
    torch's traced stages accept a model input only in the first stage, and every later one receives what it
    needs from the stage before it (the schedule hands every stage the step's keyword inputs)."""

    class FirstTakesKeywords(base):
        def forward_maybe_with_nosync(self, *args, **kwargs):
            return super().forward_maybe_with_nosync(*args, **(kwargs if self.is_first else {}))

    return FirstTakesKeywords


def traced_stages(pipe, stage_ids: list[int], *, pp_mesh: DeviceMesh, device: torch.device) -> list:
    """torch's traced stages for this rank's stage ids (their submodules parallelised in place before)."""
    from torch.distributed.pipelining.stage import _PipelineStage

    stages = []
    for sid in stage_ids:
        stage = pipe.build_stage(sid, device, pp_mesh.get_group())
        # build_stage also rewrites the graph's device
        stage.__class__ = _traced_stage_class(_warm_up_other_ranks_only(_PipelineStage))
        stages.append(stage)
    # The stages keep the split graph (pipe_info), which holds every stage's submodule: drop the
    # other ranks' stages so their (whole-model, CPU) tensors are freed.
    mine = {id(pipe.get_stage_module(sid)) for sid in stage_ids}
    for name, module in list(pipe.split_gm.named_children()):
        if id(module) not in mine:
            delattr(pipe.split_gm, name)
    return stages


def manual_stages(plan: PipelinePlan, chunks: list[nn.Module], stage_ids: list[int], *, pp_mesh: DeviceMesh,
                  device: torch.device, example_args: Callable[[int], tuple] | None = None) -> list:
    """torch PipelineStages around this rank's manual chunks."""
    from torch.distributed.pipelining import PipelineStage

    stages = []
    for chunk, sid in zip(chunks, stage_ids, strict=True):
        # example_args: (inputs, outputs) of stage sid, so that torch skips its metadata inference (a real
        # forward and backward per stage at the first step, which collectives inside the stages cannot join).
        inputs, outputs = example_args(sid) if example_args is not None else (None, None)
        stages.append(_warm_up_other_ranks_only(PipelineStage)(
            chunk, stage_index=sid, num_stages=plan.num_stages, device=device, group=pp_mesh.get_group(),
            input_args=inputs, output_args=outputs))
    return stages


def build_schedule(plan: PipelinePlan, stages: list, *, n_microbatches: int, loss_fn: Callable,
                   csv_path: str = "") -> "_PipelineSchedule":
    """The configured schedule driving this rank's stages (manual or traced).

    ``scale_grads=False``: the step divides gradients by its global token count itself, so the
    schedule must not divide by the number of microbatches as well.
    """
    from torch.distributed.pipelining import schedules
    if plan.traits.from_file:
        schedule = schedules._PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        data = Path(csv_path).read_bytes()
        # a byte-order mark (spreadsheet exports): torch reads it as part of a cell
        if data.startswith(b"\xef\xbb\xbf"):
            with tempfile.NamedTemporaryFile("wb", suffix=".csv", delete=False) as copy:
                copy.write(data[3:])
            try:
                schedule._load_csv(copy.name)
            finally:
                os.unlink(copy.name)
        else:
            schedule._load_csv(csv_path)
        return schedule
    traits = SCHEDULES[plan.schedule]
    cls = getattr(schedules, traits.torch_class)
    if traits.stages_per_rank == "one":
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_stages(schedule: "_PipelineSchedule") -> list:
    """The PipelineStages a schedule drives on this rank (torch keeps them privately: one or a list)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def wrap_schedule_loss(schedule: "_PipelineSchedule", wrap: Callable[[Callable], Callable]) -> None:
    """Replace the loss function the schedule calls by ``wrap(loss_fn)`` (torch keeps it privately)."""
    if getattr(schedule, "_loss_fn", None) is not None:
        schedule._loss_fn = wrap(schedule._loss_fn)


def run_schedule(schedule: "_PipelineSchedule", inputs: torch.Tensor, labels: torch.Tensor, *,
                 has_first: bool, has_last: bool, model_kwargs: dict | None = None) -> list[torch.Tensor]:
    """One forward/backward over a batch; returns the per-microbatch losses (last stage only).
    ``model_kwargs`` (batch-first tensors, e.g. ``documents``) are split into microbatches like the
    inputs and reach every stage's forward."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if has_first else ()
    if has_last:
        schedule.step(*args, target=labels, losses=losses, return_outputs=False, **(model_kwargs or {}))
    else:
        schedule.step(*args, return_outputs=False, **(model_kwargs or {}))
    return losses
