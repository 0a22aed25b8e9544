"""Tensor-parallel plan of the MoE family: Llama's for attention and the dense blocks; the MoE
feed-forward runs whole on every tensor-parallel rank (its tokens are replicated there), its
shared experts column/row-wise like a dense feed-forward.

With sequence parallelism the MoE block gathers the sequence on entry and keeps its rank's
part of the result on exit; every tensor-parallel rank routes the same tokens to the same
experts, so the expert and router gradients are equal across those ranks and need no reduction.
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInputOutput, RowwiseParallel

from trainer.models.decoder.tp_plan import build_tp_plan as llama_plan


def build_tp_plan(*, sequence_parallel: bool,
                  loss_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    top, block = llama_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    block.update({
        "moe.shared_experts.w1": ColwiseParallel(),
        "moe.shared_experts.w3": ColwiseParallel(),
        "moe.shared_experts.w2": RowwiseParallel(),
    })
    if sequence_parallel:
        block["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        )
    return top, block
