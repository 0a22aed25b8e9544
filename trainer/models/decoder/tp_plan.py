"""Tensor-parallel plan of the shared decoder, applied from outside by trainer.parallel.tp (a block plan entry whose
module a block lacks, such as a norm after the branch, is skipped).

Column-wise q/k/v and gate/up projections, row-wise output and down projections (one
all-reduce or reduce-scatter per attention and per MLP), a vocabulary-parallel embedding,
and the output projection sharded over the vocabulary for loss parallelism.
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def build_tp_plan(
    *, sequence_parallel: bool, loss_parallel: bool
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(plan for top-level modules, plan for the modules of one block).

    With sequence parallelism the residual stream between blocks is sharded along the
    sequence (Shard(1)): norms run on their shard, and each attention/MLP gathers the full
    sequence on entry and reduce-scatters on exit. Without it the stream is replicated.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # Loss parallel: logits stay sharded over the vocabulary; cross-entropy runs on shards.
        "output": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                "attention_out_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "ffn_out_norm": SequenceParallel(),
                # forward(x, rope): gather x's sequence shards; rope is a plain, replicated tensor.
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return top, block
