"""Pipeline parallelism at run time: model chunks, PipelineStages and the schedule.

A chunk is the family's model class built whole on the meta device with the parts its stage
does not own removed, so parameter names are those of the whole model.
"""

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config.schedules import SCHEDULES
from trainer.models import ModelSpec
from trainer.parallel.pipeline_split import PipelinePlan, Stage

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


def build_schedule(
    plan: PipelinePlan,
    chunks: list[nn.Module],
    stage_ids: list[int],
    *,
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable,
    csv_path: str = "",
    example_args: Callable[[int], tuple] | None = None,
) -> "_PipelineSchedule":
    """PipelineStages for this rank's chunks, driven by the configured schedule.

    ``scale_grads=False``: the step divides gradients by its global token count itself, so the
    schedule must not divide by the number of microbatches as well.
    """
    from torch.distributed.pipelining import PipelineStage, schedules

    group = pp_mesh.get_group()
    stages = []
    for chunk, sid in zip(chunks, stage_ids):
        # example_args: (inputs, outputs) of stage sid, so that torch skips its metadata inference (a real
        # forward and backward per stage at the first step, which collectives inside the stages cannot join).
        inputs, outputs = example_args(sid) if example_args is not None else (None, None)
        stages.append(PipelineStage(chunk, stage_index=sid, num_stages=plan.num_stages, device=device, group=group,
                                    input_args=inputs, output_args=outputs))
    if plan.schedule == "csv":
        schedule = schedules._PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
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


def run_schedule(schedule: "_PipelineSchedule", inputs: torch.Tensor, labels: torch.Tensor, *,
                 has_first: bool, has_last: bool) -> list[torch.Tensor]:
    """One forward/backward over a batch; returns the per-microbatch losses (last stage only)."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if has_first else ()
    if has_last:
        schedule.step(*args, target=labels, losses=losses, return_outputs=False)
    else:
        schedule.step(*args, return_outputs=False)
    return losses
