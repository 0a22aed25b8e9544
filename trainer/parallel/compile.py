"""torch.compile per block (in place: parameter names stay as they are)."""

from torch import nn

from trainer.models.registry import model_blocks


def apply_compile(model: nn.Module, *, layers_attr: str) -> None:
    # Blocks are identical, so one compiled graph serves them all; the top level stays eager.
    for block in model_blocks(model, layers_attr).values():
        block.compile(fullgraph=False)
