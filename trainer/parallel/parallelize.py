"""``parallelize``: the one place that composes TP, activation checkpointing, compile and FSDP/DDP."""

import logging

import torch
from torch import nn

from trainer.config.schema import ActivationCheckpoint, Parallelism
from trainer.dtypes import torch_dtype
from trainer.errors import ConfigError
from trainer.models import ModelSpec
from trainer.parallel.ac import apply_ac
from trainer.parallel.auto_tp import TPPlan, derive_tp_plan
from trainer.parallel.compile import apply_compile
from trainer.parallel.ddp import apply_ddp
from trainer.parallel.ep import apply_ep
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.mesh import Meshes
from trainer.parallel.tp import apply_tp

logger = logging.getLogger(__name__)



def resolve_tp_plan(spec: ModelSpec, whole: nn.Module, parallelism: Parallelism, *, seq_len: int) -> TPPlan | None:
    """The TP plan for ``[parallelism]``, from the family or derived; None without TP.

    ``whole`` is the complete model on the meta device (derivation runs one meta forward).
    """
    tp = parallelism.tensor_parallel_degree
    if tp == 1:
        return None
    loss_parallel = not parallelism.disable_loss_parallel
    if parallelism.tensor_parallel_plan == "auto":
        if not spec.auto_tp:
            raise ConfigError(f"[parallelism] tensor_parallel_plan = \"auto\": model family {spec.name} must use its own"
                              " plan; set tensor_parallel_plan = \"model\"")
        if parallelism.enable_sequence_parallel:
            logger.warning("[parallelism] enable_sequence_parallel is not applied with tensor_parallel_plan = auto")
        return derive_tp_plan(whole, layers_attr=spec.layers_attr, pre=spec.pre_layers, post=spec.post_layers,
                              tp=tp, seq_len=seq_len, loss_parallel=loss_parallel,
                              overrides=parallelism.tensor_parallel_overrides)
    if spec.build_tp_plan is None:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree={tp}: model family {spec.name} has no hand-written TP plan;"
            " set [parallelism] tensor_parallel_plan = \"auto\""
        )
    top, block = spec.build_tp_plan(sequence_parallel=parallelism.enable_sequence_parallel, loss_parallel=loss_parallel)
    return TPPlan(top, block, derived=False)


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    meshes: Meshes,
    *,
    tp_plan: TPPlan | None,
    parallelism: Parallelism,
    activation_checkpoint: ActivationCheckpoint,
    compile_enabled: bool,
    param_dtype: torch.dtype,
    reduce_dtype: str,
    pipelined: bool = False,
) -> None:
    """Apply every SPMD technique the job asks for to ``model`` (a whole model or a pipeline chunk), in place.

    ``tp_plan`` comes from ``resolve_tp_plan``; ``parallelism`` and ``activation_checkpoint`` are
    those config sections.
    """
    # 1. TP first: it turns parameters into DTensors on the tp mesh, which everything after
    #    (checkpoint hooks, compiled graphs, FSDP's 2-D sharding) must see.
    if meshes.tp is not None:
        apply_tp(model, meshes.tp, top_plan=tp_plan.top, block_plan=tp_plan.block, layers_attr=spec.layers_attr)
    # 1b. EP: expert weights become DTensors sharded over the ep ranks; tokens reach them by all-to-all.
    if meshes.ep is not None:
        apply_ep(model, meshes.ep)
    # 2. AC before compile, so the compiled region includes the recomputation boundaries.
    apply_ac(
        model, mode=activation_checkpoint.mode, option=activation_checkpoint.selective_ac_option,
        layers_attr=spec.layers_attr,
    )
    # 3. Compile per block before FSDP, so FSDP's hooks stay outside the compiled graphs.
    if compile_enabled:
        apply_compile(model, layers_attr=spec.layers_attr)
    # 4. FSDP/HSDP/DDP last: it wraps whatever the block has become.
    if meshes.ddp is not None:
        apply_ddp(model, meshes.ddp, reduce_dtype=torch_dtype(reduce_dtype))
    elif meshes.fsdp is not None:
        apply_fsdp(
            model, meshes.fsdp, param_dtype=param_dtype, reduce_dtype=torch_dtype(reduce_dtype),
            reshard_after_forward=parallelism.fsdp_reshard_after_forward, layers_attr=spec.layers_attr,
            pre_layers=spec.pre_layers, post_layers=spec.post_layers, pipelined=pipelined,
            expert_mesh=meshes.expert_fsdp,
        )
