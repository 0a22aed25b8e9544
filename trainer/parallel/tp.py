"""Tensor parallelism: apply a model family's plan (DTensor ParallelStyles) to a model or chunk."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.models.registry import model_blocks
from trainer.models.tied import find_tied, retie_

if TYPE_CHECKING:  # DTensor is imported where it is used (a run without it starts ~0.5 s sooner)
    from torch.distributed.tensor.parallel import ParallelStyle

logger = logging.getLogger(__name__)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    top_plan: dict[str, ParallelStyle],
    block_plan: dict[str, ParallelStyle],
    layers_attr: str = "layers",
) -> None:
    """Shard ``model`` in place over ``tp_mesh``; modules a pipeline chunk lacks are skipped."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = {name: style for name, style in top_plan.items() if getattr(model, name, None) is not None}
    for block_name, block in model_blocks(model, layers_attr).items():
        for sub, style in block_plan.items():
            if _has_submodule(block, sub):  # blocks may differ (e.g. dense and MoE feed-forwards)
                plan[f"{layers_attr}.{block_name}.{sub}"] = style
    tied = find_tied(model)
    parallelize_module(model, tp_mesh, plan)
    retie_(model, tied)  # each style distributes its own copy; shared weights must stay one DTensor


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        return module.get_submodule(path) is not None
    except AttributeError:
        return False
