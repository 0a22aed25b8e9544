"""The pipeline's plan-time checks as a technique; the pipeline itself is ``trainer.pipeline``."""

import logging
from dataclasses import fields

from torch import nn

from trainer.errors import ConfigError
from trainer.parallel.technique import PlanFacts, Technique

logger = logging.getLogger(__name__)


class PipelineParallel(Technique):
    """``[parallelism] pipeline_parallel_degree``: the plan-time checks of the front-ends. Its runtime is not a
    per-chunk transformation: it decides what the chunks are (``trainer.pipeline.runtime`` builds them and
    the schedule that runs them), and ``ModelParts`` runs the schedule in place of a forward and backward."""

    name = "pp"

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        p, dims, spec = facts.parallelism, facts.dims, facts.spec
        if dims.pp == 1:
            default = type(p)()
            unused = [f"{f.name} = {getattr(p, f.name)!r}" for f in fields(p)
                      if f.name.startswith("pipeline_parallel_") and f.name != "pipeline_parallel_degree"
                      and getattr(p, f.name) != getattr(default, f.name)]
            if unused:
                logger.warning("[parallelism] pipeline_parallel_degree = 1: %s not used; the model runs whole, without"
                               " a pipeline schedule", ", ".join(unused))
            return
        if dims.tp > 1 and spec.tied_aliases(facts.model_args):
            # Seen on torch 2.13 (CPU, gloo): the first and last stages' copies of the tied weight reach the step
            # sharded differently (a size mismatch in the tied gradients' sum under V placement, mismatched
            # transfers under loop placement).
            raise ConfigError(f"[model] tie_embeddings with [parallelism] pipeline_parallel_degree={dims.pp} and"
                              f" tensor_parallel_degree={dims.tp}: not supported yet (the pipeline's two copies of the"
                              " tied weight are sharded differently by tensor parallelism); untie the embeddings or"
                              " drop one of the two")
        key = "[parallelism] pipeline_parallel_frontend"
        if p.pipeline_parallel_frontend == "manual":
            if not spec.manual_split:
                raise ConfigError(f"{key} = \"manual\": model family {spec.name} cannot run with stages' modules"
                                  " removed (ModelSpec.manual_split = False);"
                                  " set pipeline_parallel_frontend = \"tracer\"")
            blocks = getattr(facts.whole, spec.layers_attr, None)
            if not isinstance(blocks, nn.ModuleDict):
                raise ConfigError(f"{key} = \"manual\": model family {spec.name} holds its blocks ({spec.layers_attr})"
                                  f" in a {type(blocks).__name__}, not a ModuleDict whose entries a stage can delete;"
                                  " set pipeline_parallel_frontend = \"tracer\"")
            return
        # A traced stage is a graph of aten ops: module-level parallel styles and per-block wrappers that
        # change the forward cannot be applied to it, and torch's traced stages reject DTensor activations.
        refused = [
            (dims.tp > 1, "tensor_parallel_degree > 1 (TP plans shard nn.Linear modules, which tracing removes)"),
            (dims.cp > 1, "context_parallel_degree > 1 (torch's traced stages reject DTensor activations)"),
            (dims.ep > 1 or spec.num_experts is not None,
             "a mixture-of-experts model (routing has data-dependent shapes, which torch.export cannot trace)"),
            (bool(spec.tied_aliases(facts.model_args)), "tied embeddings ([model] tie_embeddings: torch's traced"
                                                        " stages do not exchange a weight shared by two stages; the"
                                                        " run fails in a transfer)"),
            (facts.compile_enabled, "[compile] enable (not tried on traced stages)"),
            (facts.model.attn_backend == "varlen", '[model] attn_backend = "varlen" (it reads each window\'s'
                                                   " document lengths on the host, which a traced graph cannot)"),
        ]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"{key} = \"tracer\" does not compose with {what};"
                                  " use the manual front-end or drop it")
