"""Token-mean cross-entropy that stays exact under gradient accumulation and data parallelism."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over label tokens; logits (batch, seq, vocab), labels (batch, seq).

    The caller divides by the number of label tokens in the whole global batch, so every
    microbatch, rank and pipeline stage contributes with the weight it has in one big batch.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def count_label_tokens(microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
