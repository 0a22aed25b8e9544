"""torch.compile per block (in place: parameter names stay as they are)."""

from torch import nn

from trainer.models.registry import model_blocks
from trainer.parallel.technique import ChunkSetup, Technique


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
    def build(cls, setup: ChunkSetup) -> "Compile | None":
        return cls(setup.layout.blocks) if setup.compile_enabled else None

    def apply(self, chunk: nn.Module) -> None:
        apply_compile(chunk, layers_attr=self.layers_attr)
