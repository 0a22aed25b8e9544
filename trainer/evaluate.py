"""Validation: the token-mean loss of a fixed held-out set, under any layout.

Every evaluation reads the same global batches from the start of the validation set, so its
value depends only on the weights: one process and any parallel layout give the same number
(within float32 summation order).

Pipelined models are evaluated stage after stage (``pipeline_forward``): each rank runs its chunks
in stage order and passes activations point-to-point. It does not overlap stages, but it is
the same for every schedule (the V and zero-bubble runtimes of torch 2.11-2.13 cannot run
forward-only), and evaluation is a small part of a run.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.data import WindowLoader
from trainer.data.documents import on_device
from trainer.dtensor import full_tensor
from trainer.log import Progress
from trainer.loss import count_label_tokens
from trainer.model_parts import ModelParts, summed_loss
from trainer.parallel.mesh import Meshes, all_reduce_sum

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    loss: float
    tokens: int
    seconds: float


@dataclass
class Evaluator:
    loader: WindowLoader
    num_batches: int
    """Global batches per evaluation."""
    freq: int

    def should_run(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    @torch.no_grad()
    def run(self, parts: ModelParts, meshes: Meshes, device: torch.device, *, autocast, step_context,
            progress: Callable[[], None] = lambda: None,
            model_kwargs: Callable[[torch.Tensor], dict] = lambda inputs: {}) -> Evaluation:
        """``model_kwargs(inputs)``: the model's keyword inputs of a host microbatch (its positions), as in
        training."""
        start = time.perf_counter()
        self.loader.load_state_dict({"windows": 0})
        total = torch.zeros((), device=device)
        tokens = torch.zeros((), dtype=torch.long, device=device)
        parts.chunks.eval()
        lines = Progress("validation", self.num_batches, unit="global batches")
        try:
            for batch in range(self.num_batches):
                microbatches, kwargs_of = on_device(self.loader.next_step(), device, model_kwargs)
                microbatches, kwargs_of = parts.shard_batch(microbatches), parts.shard_inputs(kwargs_of)
                for (inputs, labels), kwargs in zip(microbatches, kwargs_of, strict=True):
                    with step_context():
                        if parts.schedule is None:
                            with autocast():
                                losses = [summed_loss(parts.chunks[0](inputs, **kwargs), labels)]
                        else:
                            with autocast():
                                losses = pipeline_forward(parts, meshes, inputs, labels, kwargs)
                    for loss in losses:
                        total += full_tensor(loss).float()
                    progress()
                tokens += count_label_tokens(microbatches)
                lines.update(batch + 1)
        finally:
            parts.chunks.train()
        # Losses live on the last pipeline stage only; tokens are counted by every stage alike.
        all_reduce_sum(tokens, meshes.batch_groups())
        pp = [meshes.pp.get_group()] if meshes.pp is not None else []
        all_reduce_sum(total, meshes.batch_groups() + pp)
        return Evaluation((total / tokens).item(), int(tokens.item()), time.perf_counter() - start)


def pipeline_forward(parts: ModelParts, meshes: Meshes, inputs: torch.Tensor, labels: torch.Tensor,
                     kwargs: dict | None = None) -> list[torch.Tensor]:
    """Forward ``inputs`` through every pipeline stage in order (each stage also gets ``kwargs``); returns
    the summed loss on the rank holding the last stage (an empty list elsewhere). Activations cross ranks
    as their count, then each as a header (dtype code, ndim, shape) followed by the tensor, so stages may return
    any number of tensors of any shape."""
    kwargs = kwargs or {}
    if parts.stage_batch is not None and inputs.shape[0] != parts.stage_batch:
        # Traced stages are specialised to one microbatch's shape: evaluate microbatch by microbatch.
        pieces = zip(inputs.split(parts.stage_batch), labels.split(parts.stage_batch), strict=True)
        return [loss for i, (x, y) in enumerate(pieces) for loss in pipeline_forward(
            parts, meshes, x, y, {k: v.split(parts.stage_batch)[i] for k, v in kwargs.items()})]
    plan = parts.plan
    pp_ranks = meshes.pp.mesh.tolist()  # global rank of each pipeline rank in this rank's pp group
    group = meshes.pp.get_group()
    owner = {s: r for r in range(plan.pp) for s in plan.stage_ids(r)}
    mine = dict(zip(parts.stage_ids, parts.chunks))
    me = meshes.world.get_local_rank("pp")
    traced = parts.stage_batch is not None
    acts, losses = (inputs,), []
    for s in range(plan.num_stages):
        if owner[s] != me:
            continue
        if s > 0 and owner[s - 1] != me:
            acts = _recv(pp_ranks[owner[s - 1]], group, inputs.device)
        # a traced stage after the first takes everything from the stage before it (no keyword inputs)
        out = mine[s](*acts, **(kwargs if s == 0 or not traced else {}))
        acts = out if isinstance(out, tuple) else (out,)
        if s == plan.num_stages - 1:
            losses.append(summed_loss(acts[0], labels))
        elif owner[s + 1] != me:
            _send(acts, pp_ranks[owner[s + 1]], group)
    return losses


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 8  # dtype code, ndim, up to 6 sizes


def _send(tensors: tuple[torch.Tensor, ...], dst: int, group) -> None:
    """A stage's outputs: their count, then each as a header and the tensor."""
    device = tensors[0].device
    dist.send(torch.tensor([len(tensors)], device=device), dst=dst, group=group)
    for tensor in tensors:
        header = torch.zeros(_HEADER, dtype=torch.long, device=device)
        header[:2] = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim()])
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, dst=dst, group=group)
        dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv(src: int, group, device: torch.device) -> tuple[torch.Tensor, ...]:
    count = torch.empty(1, dtype=torch.long, device=device)
    dist.recv(count, src=src, group=group)
    tensors = []
    for _ in range(int(count)):
        header = torch.empty(_HEADER, dtype=torch.long, device=device)
        dist.recv(header, src=src, group=group)
        code, ndim, *sizes = header.tolist()
        tensor = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=device)
        dist.recv(tensor, src=src, group=group)
        tensors.append(tensor)
    return tuple(tensors)
