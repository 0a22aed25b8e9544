"""A mixture-of-experts decoder (Qwen 3 MoE / DeepSeek-V3 routing): Llama-style attention, and
feed-forward blocks of routed SwiGLU experts with token-choice top-k routing.

Like the Llama model it knows nothing about parallelism: a pipeline chunk is this model with
parts removed, and expert parallelism installs a dispatcher on each ``MoE`` module (see
trainer.parallel.ep) that moves tokens to the ranks holding their experts and back.
"""

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.dtensor import local_tensor
from trainer.models.decoder.model import (
    FeedForward,
    Transformer,
    TransformerBlock,
    attention_activation_bytes,
    attention_flops,
    attention_params,
    decoder_activation_bytes,
    swiglu_activation_bytes,
)
from trainer.models.mla import LatentAttention
from trainer.models.moe.args import MoEArgs
from trainer.models.registry import ActivationBytes, ExpertLayer

# (tokens sorted by expert (n, dim), tokens per expert (n_experts,), compute) -> outputs in the same order.
# compute(tokens sorted by local expert, tokens per local expert) runs the experts this rank holds.
Dispatch = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], torch.Tensor]


class Router(nn.Module):
    """Token-choice top-k: each token picks the k experts with the highest scores (plus the
    load-balancing bias, which only steers the choice). Ties go to the lower expert index (a
    stable sort), so every layout that computes the same scores routes the same way."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=args.router_bias)
        self.top_k, self.score_func = args.top_k, args.score_func
        self.norm_topk, self.route_scale = args.norm_topk, args.route_scale
        self.groups, self.topk_groups = args.n_expert_groups, args.topk_groups
        if args.bias_update_speed > 0 or args.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (weights (tokens, k), experts (tokens, k), scores (tokens, n_experts)), fp32."""
        bias = None if self.gate.bias is None else local_tensor(self.gate.bias).float()
        logits = F.linear(x.float(), local_tensor(self.gate.weight).float(), bias)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = (scores if self.expert_bias is None else scores + self.expert_bias).detach()
        if self.groups > 1:  # only the experts of the topk_groups groups with the best two-expert sums compete
            by_group = choose.view(choose.shape[0], self.groups, -1)
            group_scores = by_group.topk(2, dim=-1).values.sum(-1)
            best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, : self.topk_groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choose = by_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        experts = torch.sort(choose, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return weights * self.route_scale, experts, scores


class GroupedExperts(nn.Module):
    """``n_experts`` gated experts as three stacked weights (experts, out, in), like nn.Linear's layout, with
    optional stacked biases (experts, out); the gate's activation is ``expert_activation`` (see MoEArgs)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, *, use_grouped_mm: bool = True, biases: bool = False,
                 activation: str = "swiglu", limit: float = 7.0, alpha: float = 1.702):
        super().__init__()
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        if biases:  # stacked on dim 0 like the weights: expert parallelism shards them with their experts
            self.w1_bias = nn.Parameter(torch.empty(n_experts, hidden))
            self.w3_bias = nn.Parameter(torch.empty(n_experts, hidden))
            self.w2_bias = nn.Parameter(torch.empty(n_experts, dim))
        self.biases = biases
        self.gated = swiglu if activation == "swiglu" else functools.partial(clamped_swiglu, limit=limit, alpha=alpha)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens grouped by expert (this rank's experts, in order); counts: tokens per expert."""
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        b = tuple(local_tensor(getattr(self, n)) for n in ("w1_bias", "w2_bias", "w3_bias")) if self.biases else ()
        dtype = None
        if self.use_grouped_mm:
            device = x.device.type
            autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            dtype = grouped_mm_dtype(device, x.dtype, autocast)
        if dtype is not None:  # autocast does not cover torch._grouped_mm: the casts are ours
            return grouped_swiglu(x.to(dtype), counts, w1.to(dtype), w2.to(dtype), w3.to(dtype),
                                  tuple(t.to(dtype) for t in b), self.gated)
        return looped_swiglu(x, counts, w1, w2, w3, b, self.gated)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's form (MoEArgs.expert_activation = "swiglu_clamped")."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def grouped_mm_dtype(device_type: str, dtype: torch.dtype, autocast: torch.dtype | None) -> torch.dtype | None:
    """The dtype the experts run torch._grouped_mm in, or None where they loop: on CUDA in bf16, whether the
    tokens are bf16 already (FSDP's mixed precision) or autocast computes in bf16 (one device, no FSDP: the tokens
    arrive in float32 from the router's norm)."""
    if device_type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return None
    return torch.bfloat16 if (autocast or dtype) == torch.bfloat16 else None


def looped_swiglu(x, counts, w1, w2, w3, biases: tuple = (), gated=swiglu) -> torch.Tensor:
    """One matmul chain per expert that received tokens (any device; empty experts are skipped). ``biases``: the
    stacked biases of w1, w2, w3 (experts, out), or none; ``gated(gate, up)``: the activation."""
    outs = []
    # unbind, not w[e]: indexing's backward writes a zero gradient of the whole stack per expert
    for rows, a, b, c, *bias in zip(torch.split(x, counts.tolist()), w1.unbind(0), w2.unbind(0), w3.unbind(0),
                                    *(t.unbind(0) for t in biases), strict=True):
        if not rows.shape[0]:
            continue
        if bias:
            outs.append(gated(rows @ a.T + bias[0], rows @ c.T + bias[2]) @ b.T + bias[1])
        else:
            outs.append(gated(rows @ a.T, rows @ c.T) @ b.T)
    if not outs:  # no token came: an empty result that still reaches the weights (zero gradients)
        return x.new_zeros(0, w2.shape[1]) + 0 * sum(t.sum() for t in (w1, w2, w3, *biases))
    return torch.cat(outs)


def grouped_swiglu(x, counts, w1, w2, w3, biases: tuple = (), gated=swiglu) -> torch.Tensor:
    """torch._grouped_mm: all experts in one kernel per projection (CUDA, bf16); each row gets its expert's bias."""
    offs = counts.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    if biases:
        b1, b2, b3 = (t.repeat_interleave(counts, dim=0, output_size=x.shape[0]) for t in biases)
        gate, up = gate + b1, up + b3
    out = torch._grouped_mm(gated(gate, up), w2.transpose(-2, -1), offs=offs)
    return out + b2 if biases else out


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
    """Every expert on this rank: compute in place."""
    return compute(x, counts)


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives gradient 1 (it joins the training objective)
    wherever the block's output gradient arrives, so the auxiliary loss works under every pipeline schedule."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=torch.float32, device=grad.device)


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss per sequence: sum_i f_i * P_i, with f_i the expert's share of
    the sequence's choices times n_experts and P_i its mean normalised score. Returns (batch,)."""
    probs = scores / scores.sum(-1, keepdim=True)
    probs = probs.view(batch, -1, n_experts)
    per_seq = experts.reshape(batch, -1)  # (batch, seq * k) choices
    chosen = F.one_hot(per_seq, n_experts).sum(1).float()  # (batch, n_experts)
    f = chosen * n_experts / per_seq.shape[1]
    return (f * probs.mean(1)).sum(-1)


class MoE(nn.Module, ExpertLayer):
    """Routed experts plus optional shared ones. Counts the tokens each expert receives in training
    (read and reset by ``moe_after_step`` once per optimizer step)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts = args.n_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.expert_hidden_dim, args.n_experts,
                                      use_grouped_mm=args.use_grouped_mm, biases=args.expert_biases,
                                      activation=args.expert_activation, limit=args.swiglu_limit,
                                      alpha=args.swiglu_alpha)
        hidden = args.expert_hidden_dim * args.n_shared_experts
        self.shared_experts = FeedForward(args.dim, hidden) if hidden else None
        self.aux_loss_coef, self.bias_update_speed = args.aux_loss_coef, args.bias_update_speed
        self.dispatch: Dispatch = local_dispatch
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(2), persistent=False)  # (sum over sequences, sequences)

    def set_dispatch(self, dispatch: Dispatch) -> None:
        self.dispatch = dispatch

    def forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the routed experts: the k chosen ones (the pipeline cost model)."""
        return 2.0 * 3 * self.experts.w1[0].numel() * self.router.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, experts, scores = self.router(flat)
        k = experts.shape[1]
        # Pairs (token, choice) sorted by expert; the stable order keeps it the same in every layout.
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)
        routed = self.dispatch(flat[order // k], counts, self.experts)
        y = routed[order.argsort()].view(-1, k, dim)
        out = (y * weights.to(y.dtype).unsqueeze(-1)).sum(1).view(bs, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        counting = self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        if counting:  # not again when activation checkpointing recomputes this forward in backward
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        if self.aux_loss_coef > 0 and self.training and torch.is_grad_enabled():
            per_seq = sequence_balance_loss(scores, experts, bs, self.n_experts)
            if counting:
                self.aux_loss_sum += torch.stack([per_seq.detach().sum(), torch.tensor(float(bs))])
            # Weighted by the sequence's tokens: the step divides every gradient by the batch's label tokens.
            out = _AddAuxLossGrad.apply(out, self.aux_loss_coef * seq * per_seq.sum())
        return out


class MoEBlock(TransformerBlock):
    """The shared decoder's block whose feed-forward is ``moe`` (a mixture of experts) or, in the first
    ``n_dense_layers`` blocks, a dense ``feed_forward`` of ``dense_hidden_dim``; its attention latent attention
    when ``kv_lora_rank > 0``."""

    def __init__(self, args: MoEArgs, layer_id: int):
        attention = LatentAttention(args) if args.kv_lora_rank else None
        if args.is_moe_layer(layer_id):
            super().__init__(args, layer_id, MoE(args), ffn_name="moe", attention=attention)
        else:
            super().__init__(args, layer_id, FeedForward(args.dim, args.dense_hidden_dim, args.activation),
                             attention=attention)


class MoETransformer(Transformer):
    """The shared decoder's embedding, norm, output and rotary table around MoE blocks (see MoEBlock)."""

    def make_block(self, args: MoEArgs, layer_id: int) -> nn.Module:
        return MoEBlock(args, layer_id)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for module in self.modules():
            if isinstance(module, MoE):
                module.tokens_per_expert.zero_()
                module.aux_loss_sum.zero_()
                if module.router.expert_bias is not None:
                    module.router.expert_bias.zero_()


def moe_layers(chunk: nn.Module) -> dict[int, MoE]:
    """{layer index: MoE module} of the blocks this chunk holds."""
    return {int(name): block.moe for name, block in chunk.layers.items() if hasattr(block, "moe")}


@torch.no_grad()
def moe_after_step(chunk: nn.Module, sum_over_batch: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """After each optimizer step: sum the step's expert loads over the batch's ranks, move the
    balancing biases, reset the counters. Returns this chunk's metrics per layer."""
    layers = moe_layers(chunk)
    if not layers:
        return {}
    stats = torch.stack([torch.cat([m.tokens_per_expert, m.aux_loss_sum]) for m in layers.values()])
    sum_over_batch(stats)
    metrics = {}
    for row, (i, m) in zip(stats, layers.items(), strict=True):
        load, (aux_sum, seqs) = row[:-2], row[-2:]
        mean = load.mean()
        metrics[f"load_max_over_mean/layer{i}"] = float(load.max() / mean) if mean > 0 else 0.0
        if m.aux_loss_coef > 0 and seqs > 0:
            metrics[f"aux_loss/layer{i}"] = float(aux_sum / seqs)
        bias = m.router.expert_bias
        if bias is not None and mean > 0:
            bias += m.bias_update_speed * torch.sign(mean - load)
            metrics[f"bias_abs_mean/layer{i}"] = float(bias.abs().mean())
        m.tokens_per_expert.zero_()
        m.aux_loss_sum.zero_()
    return metrics


def moe_flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token from the parameters each token uses: attention, the dense blocks'
    feed-forward, and per MoE block the router, the k routed experts and the shared experts
    (6 per active matmul weight), plus attention scores as for Llama."""
    attn = attention_params(args)
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    dense = (args.n_layers - n_moe) * 3 * args.dim * args.dense_hidden_dim
    active = args.dim * args.n_experts + 3 * args.dim * args.expert_hidden_dim * (args.top_k + args.n_shared_experts)
    matmul_params = args.n_layers * attn + dense + n_moe * active + args.dim * args.vocab_size
    return 6 * matmul_params + attention_flops(args, seq_len)


def moe_idle_params(args: MoEArgs) -> int:
    """The routed experts' weights a token does not use: n_experts - top_k of them in each MoE block."""
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return n_moe * (args.n_experts - args.top_k) * 3 * args.dim * args.expert_hidden_dim


def moe_activation_bytes(args: MoEArgs, *, dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False,
                         loss_parallel: bool = False) -> ActivationBytes | str:
    """What autograd saves per token, counted from this module's operations like Llama's (checked against
    saved-tensor hooks in tests/unit/test_activation_memory.py). Attention and norms as in Llama, with
    the per-head q/k norms. A MoE feed-forward keeps, per token: the router's float32 scores and the
    int64 sort order of all experts (the chosen k are a slice of it), the chosen weights (float32; with
    ``norm_topk`` also before renormalising, and their sum), the gather and scatter indices (int64 per
    choice), the routed rows coming back (k x dim); per routed row (k per token): the row itself and
    SwiGLU's four hidden tensors; shared experts like a dense SwiGLU. In a low-precision run (bf16
    parameters, as under FSDP) the router also keeps a float32 copy of its input and the mixing weights
    a low-precision copy; under autocast the input copy is bf16, so the estimate is slightly high there.

    With expert parallelism a rank computes the rows routed to its experts: the estimate assumes an even
    share (k rows per local token) and leaves out two int64 indices per received row. Not estimated under
    tensor parallelism (each MoE block runs whole on every tp rank, with gathered inputs under SP)."""
    if tp > 1:
        return "not modelled for the moe family under tensor parallelism"
    unmodelled = decoder_activation_bytes(args, dtype_bytes=dtype_bytes, tp=tp, loss_parallel=loss_parallel)
    if isinstance(unmodelled, str):  # a decoder option the estimate leaves out
        return unmodelled
    b, k, e = dtype_bytes, args.top_k, args.n_experts
    norm, attention, outer = attention_activation_bytes(args, dtype_bytes=b, tp=tp, sequence_parallel=False,
                                                        loss_parallel=loss_parallel, qk_norm=args.qk_norm == "head")
    router = 4 * e + 8 * e + (4 * k + 4 if args.norm_topk else 0) + (4 * k if b == 4 else 4 * args.dim + b * k)
    per_row = b * args.dim + swiglu_activation_bytes(args.expert_hidden_dim, b)
    routed = 8 * k + 8 * k + b * k * args.dim + k * per_row
    shared = swiglu_activation_bytes(args.expert_hidden_dim * args.n_shared_experts, b)
    moe_ffn, dense_ffn = router + routed + shared, swiglu_activation_bytes(args.dense_hidden_dim, b)
    blocks = tuple(2 * norm + attention + (moe_ffn if args.is_moe_layer(i) else dense_ffn)
                   for i in range(args.n_layers))
    return dataclasses.replace(outer, blocks=blocks)
