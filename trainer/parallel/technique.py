"""A parallel technique is one object: what it refuses at plan time, what it does to a model chunk,
to a step's data and around each microbatch, and over how many ranks it averaged its gradients.

``trainer.parallel.parallelize.TECHNIQUES`` lists them in the order they compose. The plan runs
every technique's ``check``; a rank ``build``s the ones its job uses and ``ModelParts`` hands
each chunk, batch and step to them, so the plan, the training loop and evaluation iterate over
techniques instead of branching on each. A new technique is a subclass in its own module, one
line in ``TECHNIQUES``, its tests and its docs (docs/architecture.md, "Where to add things").
"""

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from trainer.config.schema import ActivationCheckpoint, Model, Parallelism
from trainer.models import ModelSpec
from trainer.models.registry import ModelLayout
from trainer.parallel.auto_tp import TPPlan
from trainer.parallel.dims import ParallelDims
from trainer.parallel.mesh import Meshes


@dataclass(frozen=True)
class PlanFacts:
    """What a plan-time check sees: no process group exists yet."""

    dims: ParallelDims
    spec: ModelSpec
    model_args: Any
    whole: nn.Module
    """The whole model on the meta device."""
    parallelism: Parallelism
    model: Model
    compile_enabled: bool

    @property
    def family(self) -> str:
        """The model as messages name it, e.g. ``llama3 debugmodel``."""
        return f"{self.model.name} {self.model.flavor}"


@dataclass(frozen=True)
class ChunkSetup:
    """What a technique's per-rank instance is built from: the meshes and its own derived values."""

    meshes: Meshes
    spec: ModelSpec
    layout: ModelLayout
    """Where the blocks and the pre/post modules are (``ModelSpec.layout``)."""
    parallelism: Parallelism
    activation_checkpoint: ActivationCheckpoint
    tp_plan: TPPlan | None
    seq_len: int
    param_dtype: torch.dtype
    """The compute dtype (what FSDP casts parameters to)."""
    reduce_dtype: torch.dtype
    compile_enabled: bool
    pipelined: bool


class Technique:
    """The protocol, with do-nothing defaults: a technique overrides what it takes part in."""

    name: ClassVar[str] = ""
    casts_parameters: ClassVar[bool] = False
    """Whether applying it casts parameters to the compute dtype itself (else autocast does mixed precision)."""
    skips_stage_inference: ClassVar[bool] = False
    """Whether pipeline stages must be given their shapes instead of inferring them with a forward and backward
    (whose collectives the technique's peers would not join in the same order)."""

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        """Plan time, for every job: raise ConfigError (one line naming the key) for what this technique
        cannot do with the job's model or other techniques. Called whether or not the job uses it."""

    @classmethod
    def build(cls, setup: ChunkSetup) -> "Technique | None":
        """This rank's instance, or None when the job does not use the technique."""
        return None

    def apply(self, chunk: nn.Module) -> None:
        """Transform a model chunk in place on the meta device, before its weights exist."""

    def after_materialize(self, chunk: nn.Module) -> None:
        """Adjust a chunk once its weights and buffers hold values."""

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a (batch, seq) tensor of the step's data (inputs and labels alike)."""
        return x

    def step_context(self) -> contextlib.AbstractContextManager | None:
        """Entered around each microbatch's forward and backward, in training and evaluation."""
        return None

    def after_first_step(self) -> None:
        """Raise UserError if the first step shows that the technique did not take effect."""

    def gradient_sync(self, chunk: nn.Module, enabled: bool) -> None:
        """Whether the chunk's next backward reduces gradients (off: they accumulate locally)."""

    def own_gradient_average(self, chunks: nn.ModuleList) -> tuple[list[nn.Parameter], int] | None:
        """(parameters of ``chunks``, ranks): parameters whose gradients this technique averaged over another
        number of ranks than ``ParallelDims.grad_average`` (the step rescales each group by its own count)."""
        return None
