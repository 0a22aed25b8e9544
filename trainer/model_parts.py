"""Build what one rank trains, from the job plan: its model chunk(s), parallelised and
materialised, and (with pipelining) the schedule that runs them.
"""

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer import loss as loss_mod
from trainer.dtensor import local_tensor
from trainer.models.init import materialize_
from trainer.parallel.mesh import Meshes
from trainer.parallel.parallelize import build_techniques
from trainer.pipeline.runtime import build_chunk, build_schedule, manual_stages, trace_pipeline, traced_stages
from trainer.pipeline.split import PipelinePlan
from trainer.parallel.technique import Technique
from trainer.plan import JobPlan

logger = logging.getLogger(__name__)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss every path backpropagates: cross-entropy summed over label tokens.

    The step divides gradients by the global token count afterwards (see trainer.train), so the
    loss carries no per-step state and pipeline schedules can call it at any time."""
    return loss_mod.cross_entropy_sum(logits, labels)


@dataclass
class ModelParts:
    chunks: nn.ModuleList
    """This rank's model chunks (one without pipelining)."""
    plan: PipelinePlan | None = None
    stage_ids: list[int] = field(default_factory=list)
    schedule: object | None = None
    tied_group: dist.ProcessGroup | None = None
    """Pair of pipeline ranks holding the two copies of a tied weight (None: same rank or untied)."""
    tied: list[nn.Parameter] = field(default_factory=list)
    """This rank's copies of the tied weight (0, 1 or 2 of them) whose gradients are summed."""
    techniques: list[Technique] = field(default_factory=list)
    """The parallel techniques this rank's job uses, in composition order (trainer.parallel.parallelize)."""
    after_step_hook: object | None = None
    """The family's ``ModelSpec.after_step`` (None: nothing to do after an optimizer step)."""
    step_metrics: dict[str, float] = field(default_factory=dict)
    """What ``after_step`` returned for this rank's chunks at the last step (e.g. MoE expert loads)."""
    stage_batch: int | None = None
    """Sequences a chunk accepts per call when it is a traced stage (specialised to one microbatch); None: any."""

    def after_step(self, sum_over_batch) -> None:
        """Run the family's after-step hook on every chunk (collectives over the batch's ranks)."""
        if self.after_step_hook is None:
            return
        metrics: dict[str, float] = {}
        for chunk in self.chunks:
            metrics.update(self.after_step_hook(chunk, sum_over_batch))
        self.step_metrics = metrics

    def gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients over the data-parallel ranks (DDP's reducer; FSDP
        always does). Off for all but the last of a step's microbatches: they accumulate locally."""
        for technique in self.techniques:
            for chunk in self.chunks:
                technique.gradient_sync(chunk, enabled)

    def shard_batch(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of each (inputs, labels) microbatch (the whole of it unless a technique splits
        sequences, as context parallelism does)."""
        for technique in self.techniques:
            microbatches = [(technique.shard(x), technique.shard(y)) for x, y in microbatches]
        return microbatches

    def shard_inputs(self, kwargs: list[dict]) -> list[dict]:
        """This rank's part of each microbatch's per-token model inputs ((batch, seq) tensors: ``positions``), as
        ``shard_batch`` does for the tokens."""
        for technique in self.techniques:
            kwargs = [{k: technique.shard(v) for k, v in inputs.items()} for inputs in kwargs]
        return kwargs

    def step_context(self) -> contextlib.ExitStack:
        """Every technique's context around a microbatch's forward and backward (loss parallelism, context-parallel
        attention)."""
        stack = contextlib.ExitStack()
        for technique in self.techniques:
            if (context := technique.step_context()) is not None:
                stack.enter_context(context)
        return stack

    @property
    def stage_shapes_given(self) -> bool:
        """Whether a technique needs pipeline stages built with their input and output shapes given
        (``Technique.skips_stage_inference``)."""
        return any(t.skips_stage_inference for t in self.techniques)

    @property
    def casts_parameters(self) -> bool:
        """Whether a technique (FSDP) casts parameters to the compute dtype, so that autocast is not needed."""
        return any(t.casts_parameters for t in self.techniques)

    def after_first_step(self) -> None:
        for technique in self.techniques:
            technique.after_first_step()

    def gradient_averages(self, default: int) -> list[tuple[int, list[nn.Parameter]]]:
        """(ranks, parameters) groups by the number of ranks FSDP/DDP averaged their gradients over: ``default``
        unless a technique averaged its own over another number (expert parallelism)."""
        own = [g for t in self.techniques if (g := t.own_gradient_average(self.chunks)) is not None]
        claimed = {id(p) for params, _ in own for p in params}
        rest = [p for p in self.chunks.parameters() if id(p) not in claimed]
        return [(default, rest)] + [(ranks, params) for params, ranks in own]

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
        grads = [local_tensor(p.grad) for p in self.tied]
        if len(grads) == 2:  # V placement: both copies on this rank, no communication
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        else:
            dist.all_reduce(grads[0], group=self.tied_group)


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


def build_model_parts(plan: JobPlan, meshes: Meshes, device: torch.device) -> ModelParts:
    """This rank's chunks: one meta-device model build per chunk, then TP/AC/compile/FSDP, then weights."""
    spec, pipeline = plan.spec, plan.pipeline
    traced = None  # torch's Pipe, with the tracer front-end
    if pipeline is None:
        chunks, stage_ids = [plan.build_model()], []
    else:
        stage_ids = pipeline.stage_ids(meshes.world.get_local_rank("pp"))
        if plan.traced:
            plan.check_traced_dtype(device)
            # The tracer needs real tensors: the whole model is initialised on CPU (as one process
            # would: same values), traced, and this rank keeps its stages' submodules.
            whole = plan.build_model()
            materialize_(whole, torch.device("cpu"), plan.seed)
            whole.train()
            mb = plan.microbatch_size
            example = torch.zeros(mb, plan.seq_len, dtype=torch.long)
            # the positions reach every traced stage that needs them (torch passes a model input to each stage)
            positions = {"positions": torch.arange(plan.seq_len).expand(mb, -1)} if plan.positions_always else {}
            traced = trace_pipeline(whole, pipeline, example, positions)
            del whole
            chunks = [traced.get_stage_module(i) for i in stage_ids]
        else:
            chunks = [build_chunk(plan.build_model, spec, pipeline.stages[i]) for i in stage_ids]
        logger.info("pipeline: %s (%s front-end), stages %s on this rank, split points %s", pipeline.schedule,
                    "tracer" if plan.traced else "manual", stage_ids, pipeline.split_points())
    parts = ModelParts(nn.ModuleList(chunks), pipeline, stage_ids, after_step_hook=spec.after_step,
                       stage_batch=plan.microbatch_size if plan.traced else None)
    parts.techniques = build_techniques(plan.chunk_setup(meshes, device))
    logger.info("parallel techniques on this rank, in order: %s", ", ".join(t.name for t in parts.techniques) or "none")
    for chunk in chunks:
        if traced is not None:
            chunk.to(device)  # already initialised; FSDP shards what it finds
        for technique in parts.techniques:
            technique.apply(chunk)
        if traced is None:
            materialize_(chunk, device, plan.seed)
        for technique in parts.techniques:
            technique.after_materialize(chunk)
        chunk.train()
    if pipeline is not None and plan.tied_aliases:
        # Across stages a tied weight is two parameters with equal initial values (init is keyed
        # by the canonical name); summing their gradients every step keeps them equal.
        for chunk in chunks:
            for alias, canonical in plan.tied_aliases.items():
                for name in (canonical, alias):
                    owner, _, attr = name.rpartition(".")
                    module = getattr(chunk, owner, None)
                    if module is not None:
                        parts.tied.append(getattr(module, attr))
        if pipeline.style == "loop":
            parts.tied_group = _tied_pair_group(meshes)
    if traced is not None:
        stages = traced_stages(traced, stage_ids, pp_mesh=meshes.pp, device=device)
        del traced  # the other stages' submodules (and the whole model's tensors) can go
    elif pipeline is not None:
        stages = manual_stages(pipeline, chunks, stage_ids, pp_mesh=meshes.pp, device=device,
                               example_args=_stage_examples(plan, device) if parts.stage_shapes_given else None)
    if pipeline is not None:
        parts.schedule = build_schedule(pipeline, stages, n_microbatches=plan.n_microbatches, loss_fn=summed_loss,
                                        csv_path=plan.schedule_csv)
    return parts


def _stage_examples(plan: JobPlan, device: torch.device):
    """(inputs, outputs) of each pipeline stage, as torch's PipelineStage takes them to skip its metadata
    inference: with expert parallelism the inference's forward and backward run all-to-alls that the
    expert-parallel peers do not join in the same order (seen to hang on torch 2.13)."""
    mb, seq = plan.microbatch_size, plan.seq_len
    dtype, dim = plan.compute_dtype(device), plan.layout.dim
    # Floating examples require grad: torch derives from them which gradients travel between stages.
    hidden = torch.empty(mb, seq, dim, dtype=dtype, device=device, requires_grad=True)

    def examples(stage: int) -> tuple:
        first, last = stage == 0, stage == plan.pipeline.num_stages - 1
        inputs = torch.zeros(mb, seq, dtype=torch.long, device=device) if first else hidden
        outputs = (torch.empty(mb, seq, plan.vocab_size, dtype=dtype, device=device, requires_grad=True) if last
                   else hidden)
        return (inputs,), (outputs,)

    return examples
