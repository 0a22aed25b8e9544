"""Build what one rank trains: its model chunk(s), parallelised, materialised, and (with
pipelining) the schedule that runs them. Also the loss function all paths share.
"""

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import JobConfig
from trainer.loss import cross_entropy_sum
from trainer.models import ModelSpec, resolve_model_args
from trainer.models.init import materialize_
from trainer.parallel.mesh import Meshes
from trainer.parallel.parallelize import parallelize, resolve_tp_plan
from trainer.parallel.pipeline import build_chunk, build_schedule
from trainer.parallel.pipeline_split import PipelinePlan, build_pipeline_plan

logger = logging.getLogger(__name__)


class ScaledLoss:
    """Summed cross-entropy times ``scale``.

    The trainer sets ``scale`` = data-parallel degree / label tokens in the step before each
    step, which makes gradients the token-mean of one big batch (see trainer.train). Nothing
    is recorded here: pipeline schedules also call the loss on placeholder outputs while they
    infer shapes, so losses are read from what the forward (or the schedule) returns.
    """

    def __init__(self):
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels) * self.scale


@dataclass
class ModelParts:
    chunks: nn.ModuleList
    """This rank's model chunks (one without pipelining)."""
    loss: ScaledLoss
    plan: PipelinePlan | None = None
    stage_ids: list[int] = field(default_factory=list)
    schedule: object | None = None
    tied_group: dist.ProcessGroup | None = None
    """Pair of pipeline ranks holding the two copies of a tied weight (None: same rank or untied)."""
    tied: list[nn.Parameter] = field(default_factory=list)
    """This rank's copies of the tied weight (0, 1 or 2 of them) whose gradients are summed."""

    @property
    def has_first(self) -> bool:
        return self.plan is None or 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.plan is None or self.plan.num_stages - 1 in self.stage_ids

    def tied_duplicates(self) -> list[nn.Parameter]:
        """Copies of a tied weight that the gradient norm must not count again (the first stage's counts)."""
        if len(self.tied) == 2:
            return self.tied[1:]
        return self.tied if (self.tied and not self.has_first) else []

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the two copies of a tied weight held by the first and last stage."""
        if not self.tied:
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.tied]
        if len(grads) == 2:  # V placement: both copies on this rank, no communication
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            dist.all_reduce(grads[0], group=self.tied_group)


def build_model(config: JobConfig, spec: ModelSpec) -> nn.Module:
    """The whole model of ``[model]`` on the meta device, its rotary table sized to seq_len."""
    args = resolve_model_args(spec, config.model)
    if hasattr(args, "max_seq_len"):
        args = dataclasses.replace(args, max_seq_len=config.training.seq_len)
    with torch.device("meta"):
        return spec.model_cls(args)


def pipeline_plan(config: JobConfig, spec: ModelSpec, model: nn.Module) -> PipelinePlan:
    return build_pipeline_plan(
        config.parallelism, model, layers_attr=spec.layers_attr, pre=spec.pre_layers, post=spec.post_layers,
        seq_len=config.training.seq_len,
    )


def _tied_pair_group(meshes: Meshes) -> dist.ProcessGroup:
    """Group of this rank's first- and last-pipeline-rank peers (same dp/cp/tp coordinates).

    Every rank creates every pair group, in the same order, as new_group requires.
    """
    grid = meshes.world.mesh.reshape(meshes.dims.pp, -1)
    mine = None
    for col in range(grid.shape[1]):
        ranks = [int(grid[0, col]), int(grid[-1, col])]
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def build_model_parts(config: JobConfig, spec: ModelSpec, meshes: Meshes, device: torch.device,
                      param_dtype: torch.dtype) -> ModelParts:
    loss = ScaledLoss()
    whole = build_model(config, spec)
    if meshes.pp is None:
        chunks, stage_ids, plan = [whole], [], None
    else:
        plan = pipeline_plan(config, spec, whole)
        stage_ids = plan.stage_ids(meshes.world.get_local_rank("pp"))
        chunks = [build_chunk(lambda: build_model(config, spec), spec, plan.stages[i]) for i in stage_ids]
        logger.info("pipeline: %s, stages %s on this rank, split points %s",
                    plan.schedule, stage_ids, plan.split_points(spec.layers_attr))
    parts = ModelParts(nn.ModuleList(chunks), loss, plan, stage_ids)
    tp_plan = resolve_tp_plan(spec, whole, config.parallelism, seq_len=config.training.seq_len)
    for chunk in chunks:
        parallelize(
            chunk, spec, meshes,
            tp_plan=tp_plan,
            parallelism=config.parallelism,
            activation_checkpoint=config.activation_checkpoint,
            compile_enabled=config.compile.enable,
            param_dtype=param_dtype,
            reduce_dtype=config.training.mixed_precision_reduce,
            pipelined=plan is not None,
        )
        materialize_(chunk, device, config.debug.seed)
        chunk.train()
    tied_names = spec.tied_weights if getattr(whole.args, "tie_embeddings", False) else {}
    if plan is not None and tied_names:
        # Across stages a tied weight is two parameters with equal initial values (init is keyed
        # by the canonical name); summing their gradients every step keeps them equal.
        for chunk in chunks:
            for alias, canonical in tied_names.items():
                for name in (canonical, alias):
                    owner, _, attr = name.rpartition(".")
                    module = getattr(chunk, owner, None)
                    if module is not None:
                        parts.tied.append(getattr(module, attr))
        if plan.style == "loop":
            parts.tied_group = _tied_pair_group(meshes)
    if plan is not None:
        parts.schedule = build_schedule(
            plan, chunks, stage_ids, pp_mesh=meshes.pp, device=device,
            n_microbatches=config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size,
            loss_fn=loss, csv_path=config.parallelism.pipeline_parallel_schedule_csv,
        )
    return parts
