"""A model family whose parts cost known times: each sleeps, for bench_pipeline_plan.py's ``sleep`` models.

Named in a job as ``[model] modules = ["sleep_model"]`` (with benchmarks/ on ``PYTHONPATH``) and ``[model]
name = "sleep"``. Every block and the part after the blocks sleeps its milliseconds in the forward (F), in
the gradient of its input (I) and in the gradient of its weight (W), and reports FLOPs in proportion through
``forward_flops_per_token`` (F = I = W per weight, as the FLOP model prices a Linear). So the planner's FLOP
model prices this family exactly, up to what the FLOP model leaves out, which is here almost nothing: the
embedding, the output projection and the loss are tiny (dim 16, vocabulary 512).

What a pipeline of it measures is then the simulation alone: whether torch's schedules, run over gloo, take
the steps and leave the bubbles that the replay of their actions predicts, with a pipeline's real transfers
and per-action overheads, and with no compute to contend for this CPU's two cores (a sleeping rank leaves its
core alone). A split the planner gets wrong here is the simulation's fault, not a price's.
"""

import time
from dataclasses import dataclass

import torch
from torch import nn

from trainer.models import ModelSpec, register_model
from trainer.models.init import constant_, init_param_, normal_

FLOPS_PER_MS = 1e9  # reported per token for each millisecond a part sleeps: far above the tiny real matmuls


@dataclass(frozen=True, kw_only=True)
class SleepArgs:
    dim: int = 16
    n_layers: int = 6
    vocab_size: int = 512
    block_ms: tuple[float, ...] = (8.0,)
    """Each block's sleep in F, in I and in W, in milliseconds per microbatch; repeated over the blocks."""
    post_ms: float = 16.0
    """The part after the blocks: its sleep in F, I and W (16: two equal blocks, as the output part of an 8k
    vocabulary costs against the debug model's blocks)."""


class _InputSleep(torch.autograd.Function):
    """The input's path: sleeps ``fwd`` in the forward and ``inp`` in the backward (the input's gradient)."""

    @staticmethod
    def forward(ctx, x, fwd, inp):
        ctx.inp = inp
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.inp)
        return grad, None, None


class _WeightSleep(torch.autograd.Function):
    """The weight's path: free in the forward, sleeps ``wgt`` in the backward (run only when the weight's gradient
    is asked for: torch's split backward runs it in W, not in I)."""

    @staticmethod
    def forward(ctx, w, wgt):
        ctx.wgt = wgt
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.wgt)
        return grad, None


class SleepPart(nn.Module):
    def __init__(self, dim: int, ms: float):
        super().__init__()
        self.ms = ms
        self.weight = nn.Parameter(torch.empty(dim))

    def forward_flops_per_token(self) -> float:
        return self.ms * FLOPS_PER_MS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, dim)
        s = self.ms / 1e3
        return _InputSleep.apply(x, s, s) * _WeightSleep.apply(self.weight, s)


class SleepModel(nn.Module):
    def __init__(self, args: SleepArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        ms = args.block_ms
        self.layers = nn.ModuleDict({str(i): SleepPart(args.dim, ms[i % len(ms)]) for i in range(args.n_layers)})
        self.post = SleepPart(args.dim, args.post_ms)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids) if self.tok_embeddings is not None else ids
        for layer in self.layers.values():
            h = layer(h)
        if self.post is not None:
            h = self.post(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, seed: int) -> None:
        for name, param in self.named_parameters():
            fn = constant_(1.0) if name.endswith(".weight") and param.ndim == 1 else normal_(0.02)
            init_param_(param, name, seed, fn)


def sleep_flops(a: SleepArgs, seq_len: int) -> float:
    """Training FLOPs per token as reported: F, I and W of every block and of the part after them."""
    blocks = sum(a.block_ms[i % len(a.block_ms)] for i in range(a.n_layers))
    return 3 * FLOPS_PER_MS * (blocks + a.post_ms)


register_model(
    ModelSpec(
        name="sleep",
        model_cls=SleepModel,
        # "unequal": blocks of three sizes and a light output part, a second shape for every finding of "equal"
        flavors={"equal": SleepArgs(), "unequal": SleepArgs(block_ms=(4.0, 12.0, 8.0, 8.0, 12.0, 4.0), post_ms=6.0)},
        flops_per_token=sleep_flops,
        pre_layers=("tok_embeddings",),
        post_layers=("post", "output"),
    )
)
