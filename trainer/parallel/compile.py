"""torch.compile per block (in place: parameter names stay as they are)."""

from torch import nn

from trainer.errors import ConfigError
from trainer.models.registry import model_blocks
from trainer.parallel.technique import PlanFacts, ChunkSetup, Technique


def apply_compile(model: nn.Module, *, layers_attr: str) -> None:
    # Blocks are identical, so one compiled graph serves them all; the top level stays eager.
    for block in model_blocks(model, layers_attr).values():
        block.compile(fullgraph=False)


class Compile(Technique):
    """``[compile] enable``: each block compiled with torch.compile."""

    name = "compile"

    def __init__(self, layers_attr: str):
        self.layers_attr = layers_attr

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        if not facts.compile_enabled:
            return
        if facts.dims.tp > 1:
            # Seen on torch 2.13 (CPU, gloo): a compiled tensor-parallel block fails in its first forward
            # ("'Tensor' object has no attribute '_local_tensor'"), and under activation checkpointing in its first
            # backward; no tensor-parallel compiled run has been proven equal to one process.
            raise ConfigError(f"[compile] enable with [parallelism] tensor_parallel_degree={facts.dims.tp}: not"
                              " supported yet (torch.compile of tensor-parallel blocks fails in torch's DTensor"
                              " tracing); set [compile] enable = false")
        if facts.dims.pp > 1:
            from trainer.config.schedules import schedule_traits

            name, traits = schedule_traits(facts.parallelism)
            if traits.split_backward:
                # Seen on torch 2.13: the compiled backward refuses a second pass over its graph ("non-empty donated
                # buffers"); with its buffers kept it runs, and the weight gradients come out wrong (relative
                # error 1.0 on a block's weights against one process).
                raise ConfigError(f"[compile] enable with [parallelism] pipeline_parallel_schedule={name}: not"
                                  " supported (a compiled block's backward is one step, which the schedule's separate"
                                  " input- and weight-gradient passes cannot split); use a schedule without the split"
                                  " backward (1F1B, Interleaved1F1B, ...) or set [compile] enable = false")

    @classmethod
    def build(cls, setup: ChunkSetup) -> "Compile | None":
        return cls(setup.layout.blocks) if setup.compile_enabled else None

    def apply(self, chunk: nn.Module) -> None:
        apply_compile(chunk, layers_attr=self.layers_attr)
