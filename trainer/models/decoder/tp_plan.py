"""Tensor-parallel plan of the shared decoder, applied from outside by trainer.parallel.tp (a block plan entry whose
module a block lacks, such as a norm after the branch, is skipped).

Column-wise q/k/v and gate/up projections, row-wise output and down projections (one
all-reduce or reduce-scatter per attention and per MLP), a vocabulary-parallel embedding,
and the output projection sharded over the vocabulary for loss parallelism.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


class HeadNormParallel(ParallelStyle):
    """The per-head q/k RMSNorm on (batch, seq, heads, head_dim) whose heads are split over the tp ranks: the
    weight is a replicated DTensor, so its gradient (each rank's heads contribute) is summed over the ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
                                                     for t in inputs),
            output_fn=lambda mod, out, mesh: out.to_local(),
        )


class HeadShardParallel(ParallelStyle):
    """A module holding one value per query head (attention sinks): its parameters are sharded on dim 0 like the
    heads, so each rank reads the values of its own heads (``local_tensor``) and their gradients stay per head."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        return distribute_module(module, device_mesh, partition_fn=shard)


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
        # per-head q/k norms (Qwen 3, Gemma 3); a norm over the whole projection is refused under TP
        "attention.q_norm": HeadNormParallel(),
        "attention.k_norm": HeadNormParallel(),
        "attention.sinks": HeadShardParallel(),  # gpt-oss
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                # after a branch, added to the (local) residual stream: its output a local tensor too
                "attention_out_norm": SequenceParallel(use_local_output=True),
                "ffn_norm": SequenceParallel(),
                "ffn_out_norm": SequenceParallel(use_local_output=True),
                # forward(x, rope): gather x's sequence shards; rope is a plain, replicated tensor.
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return top, block
