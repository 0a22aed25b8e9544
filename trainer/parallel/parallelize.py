"""The one place that composes the parallel techniques (``TECHNIQUES``, in order), and the TP plan."""

import logging

from torch import nn

from trainer.config.schema import Parallelism
from trainer.errors import ConfigError
from trainer.models import ModelSpec
from trainer.models.registry import ModelLayout
from trainer.parallel.ac import ActivationCheckpointing
from trainer.parallel.auto_tp import TPPlan, derive_tp_plan
from trainer.parallel.compile import Compile
from trainer.parallel.cp import ContextParallel
from trainer.parallel.ddp import PlainDDP
from trainer.parallel.ep import ExpertParallel
from trainer.parallel.fsdp import FullyShardedDataParallel
from trainer.parallel.pp import PipelineParallel
from trainer.parallel.technique import ChunkSetup, PlanFacts, Technique
from trainer.parallel.tp import TensorParallel

logger = logging.getLogger(__name__)


def resolve_tp_plan(spec: ModelSpec, layout: ModelLayout, whole: nn.Module, parallelism: Parallelism, *,
                    seq_len: int) -> TPPlan | None:
    """The TP plan for ``[parallelism]``, from the family or derived; None without TP.

    ``whole`` is the complete model on the meta device (derivation runs one meta forward), ``layout`` its
    ``ModelSpec.layout``.
    """
    tp = parallelism.tensor_parallel_degree
    if tp == 1:
        return None
    loss_parallel = not parallelism.disable_loss_parallel
    if parallelism.tensor_parallel_plan == "auto":
        if not spec.auto_tp:
            raise ConfigError(f"[parallelism] tensor_parallel_plan = \"auto\": model family {spec.name}"
                              " must use its own plan; set tensor_parallel_plan = \"model\"")
        if parallelism.enable_sequence_parallel:
            logger.warning("[parallelism] enable_sequence_parallel is not applied with tensor_parallel_plan = auto")
        return derive_tp_plan(whole, layout, tp=tp, seq_len=seq_len, loss_parallel=loss_parallel,
                              overrides=parallelism.tensor_parallel_overrides)
    if spec.build_tp_plan is None:
        raise ConfigError(
            f"[parallelism] tensor_parallel_degree={tp}: model family {spec.name} has no hand-written TP plan;"
            " set [parallelism] tensor_parallel_plan = \"auto\""
        )
    top, block = spec.build_tp_plan(sequence_parallel=parallelism.enable_sequence_parallel, loss_parallel=loss_parallel)
    return TPPlan(top, block, derived=False)


# The order techniques compose in, each for a reason:
# 1. TP first: it turns parameters into DTensors on the tp mesh, which everything after (checkpoint
#    hooks, compiled graphs, FSDP's 2-D sharding) must see.
# 2. EP: expert weights become DTensors sharded over the ep ranks; tokens reach them by all-to-all.
# 3. AC before compile, so the compiled region includes the recomputation boundaries.
# 4. Compile per block before FSDP, so FSDP's hooks stay outside the compiled graphs.
# 5. CP changes no module (it re-indexes buffers once the weights exist, shards the data, and rewrites
#    attention during a step).
# 6. DDP or FSDP/HSDP last: it wraps whatever the block has become.
# 7. PP only checks here: it decides what the chunks are (trainer.parallel.pipeline).
TECHNIQUES: list[type[Technique]] = [
    TensorParallel, ExpertParallel, ActivationCheckpointing, Compile, ContextParallel, PlainDDP,
    FullyShardedDataParallel, PipelineParallel,
]


def check_techniques(facts: PlanFacts) -> None:
    """Every technique's plan-time checks (raises ConfigError)."""
    for technique in TECHNIQUES:
        technique.check(facts)


def build_techniques(setup: ChunkSetup) -> list[Technique]:
    """This rank's instances of the techniques its job uses, in composition order."""
    return [t for cls in TECHNIQUES if (t := cls.build(setup)) is not None]
