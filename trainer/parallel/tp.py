"""Tensor parallelism: apply a model family's plan (DTensor ParallelStyles) to a model or chunk."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.errors import ConfigError
from trainer.models.registry import model_blocks
from trainer.models.tied import find_tied, retie_
from trainer.parallel.auto_tp import TPPlan
from trainer.parallel.technique import ChunkSetup, PlanFacts, Technique

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


class TensorParallel(Technique):
    """``[parallelism] tensor_parallel_degree``: the family's (or the derived) plan over the tp mesh, and the
    loss computed on vocabulary-sharded logits (loss parallel) unless ``disable_loss_parallel``."""

    name = "tp"

    def __init__(self, mesh: DeviceMesh, plan: TPPlan, layers_attr: str, loss_parallel: bool):
        self.mesh, self.plan, self.layers_attr, self.loss_parallel = mesh, plan, layers_attr, loss_parallel

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        tp = facts.dims.tp
        if tp == 1:
            return
        for name, count in facts.spec.tp_divisible(facts.model_args).items():
            if count % tp:
                raise ConfigError(
                    f"[parallelism] tensor_parallel_degree={tp} must divide model {name}={count} ({facts.family})")

    @classmethod
    def build(cls, setup: ChunkSetup) -> "TensorParallel | None":
        if setup.meshes.tp is None:
            return None
        return cls(setup.meshes.tp, setup.tp_plan, setup.layout.blocks,
                   loss_parallel=not setup.parallelism.disable_loss_parallel)

    def apply(self, chunk: nn.Module) -> None:
        apply_tp(chunk, self.mesh, top_plan=self.plan.top, block_plan=self.plan.block, layers_attr=self.layers_attr)

    def step_context(self):
        if not self.loss_parallel:
            return None
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
