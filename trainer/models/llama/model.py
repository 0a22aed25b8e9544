"""A Llama-3-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model knows nothing about parallelism. ``tok_embeddings``, ``norm`` and ``output`` may be
set to None and entries of ``layers`` deleted: that is how a pipeline chunk is made, and
parameter names stay those of the whole model.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.attention import block_causal_mask
from trainer.models.init import InitFn, constant_, init_param_, normal_
from trainer.models.llama.args import LlamaArgs
from trainer.models.registry import ActivationBytes

# With tie_embeddings, the output projection is the embedding matrix. A pipeline stage that
# holds only the output projection initialises it under the embedding's name, so both copies
# start equal.
TIED_WEIGHTS = {"output.weight": "tok_embeddings.weight"}


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) table of (cos, sin) for each position and frequency."""
    if torch.empty(0, device=device).is_meta:  # shape only (meta arange would import torch._dynamo)
        return torch.empty(max_seq_len, head_dim // 2, 2, device=device)
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (batch, seq, heads, head_dim) by their position's angle: row i of
    ``table`` (positions, head_dim / 2, 2) for token i, or ``table`` (batch, seq, head_dim / 2, 2) per token.

    One complex multiply: the pair (x0, x1) is x0 + i x1 and the table's (cos, sin) is e^(i angle).
    It gives the same bits as the four real products and a sum (x0 cos - x1 sin, x0 sin + x1 cos)
    and ran ~9x faster forward and backward on CPU (benchmarks: docs/performance.md)."""
    seq = x.shape[1]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (batch, seq, heads, head_dim/2)
    per_token = table.dim() == 4
    # (..., seq, 1, head_dim/2)
    angles = torch.view_as_complex(table[:, :seq, None] if per_token else table[:seq, None])
    return torch.view_as_real(pairs * angles).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings; ``qk_norm`` adds an RMSNorm over each head of
    q and k before the rotation (Qwen 3)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qk_norm: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.kv_cache: KVCache | None = None
        """Set for generation (trainer/generate.py): keys and values of the earlier positions are kept, and
        ``x`` holds only the positions after them."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: "torch.Tensor | DocumentLengths | None" = None
                ) -> torch.Tensor:
        """``mask``: (batch, 1, seq, seq) additive mask of the keys each query may see (documents), or each
        window's document lengths (attended one by one); None = causal."""
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cache = self.kv_cache
        start = 0 if cache is None else cache.length
        if cache is not None and mask is not None:
            raise ValueError("generation with a KV cache takes one document: no mask")
        q, k = apply_rope(q, rope[start:]), apply_rope(k, rope[start:])
        if cache is not None:
            k, v = cache.append(k, v)
            if start and seq > 1:  # new positions attend to every cached one and causally among themselves
                mask = (torch.arange(start + seq, device=x.device)
                        <= torch.arange(start, start + seq, device=x.device)[:, None])
        # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads. On CUDA, no fused kernel
        # takes both a mask and grouped heads (flash takes no mask, memory-efficient no enable_gqa), and the
        # fallback keeps every head's scores: with a mask, the kv heads are repeated instead (the CPU kernel
        # takes both).
        grouped = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, DocumentLengths):
            out = per_document_attention(q, k, v, mask, enable_gqa=grouped)
        else:
            if grouped and mask is not None and q.is_cuda:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
                grouped = False
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and start == 0,
                                                 enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


@dataclasses.dataclass(frozen=True)
class DocumentLengths:
    """The lengths of each window's documents, in order (each window's sum to its length): block-causal
    attention computed as one causal attention per document, without a mask (``[model] attn_backend =
    "varlen"``, on CPU: the lengths are read from the positions on the host)."""

    per_window: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, positions: torch.Tensor) -> "DocumentLengths":
        """From each token's position within its document (a document starts where it is 0)."""
        documents = (positions == 0).cumsum(1)
        return cls(tuple(tuple(torch.unique_consecutive(row, return_counts=True)[1].tolist()) for row in documents))


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: DocumentLengths, *,
                           enable_gqa: bool) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) ``q``, ``k``, ``v`` within each document alone, causal inside
    it: the causal kernel once per document, on that document's rows only, so the cost is the sum of the
    squared document lengths, not the squared window. Splitting (rather than slicing) each window makes
    backward one concatenation per tensor instead of a zero-filled full-size gradient per document."""
    windows = []
    for qw, kw, vw, sizes in zip(q.unbind(0), k.unbind(0), v.unbind(0), lengths.per_window, strict=True):
        parts = [F.scaled_dot_product_attention(a[None], b[None], c[None], is_causal=True, enable_gqa=enable_gqa)
                 for a, b, c in zip(qw.split(sizes, dim=1), kw.split(sizes, dim=1), vw.split(sizes, dim=1))]
        windows.append(torch.cat(parts, dim=2)[0])
    return torch.stack(windows)


def document_attention(positions: torch.Tensor | None, table: torch.Tensor, hidden: torch.Tensor, *,
                       per_document: bool = False) -> tuple[torch.Tensor, "torch.Tensor | DocumentLengths | None"]:
    """(rotary table, attention mask) for tokens at ``positions`` (batch, seq) within their documents, built
    once per forward and shared by the layers: the table gathered at each token's position, (batch, seq,
    head_dim / 2, 2), and the additive block-causal mask (trainer.models.attention.block_causal_mask) in the
    dtype attention computes in: autocast's, else ``hidden``'s. No value is read back from the device: whether a
    batch needs a mask at all is decided on the host, where the tokens are (trainer.data.documents.model_inputs
    gives no ``positions`` for a batch in which every window is one document, and that batch keeps the causal
    kernel and the table as it is). With ``per_document`` (the varlen backend, CPU only), instead of the mask:
    each window's document lengths (``DocumentLengths``), read from ``positions`` on the host."""
    if positions is None:
        return table, None
    if per_document:
        return table[positions], DocumentLengths.of(positions)
    device = hidden.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    return table[positions], block_causal_mask(positions, dtype)


class KVCache:
    """One attention layer's keys and values of the positions generated so far, in buffers of ``max_len``."""

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device):
        self.k = torch.empty(batch, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; returns those of every position so far."""
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            raise ValueError(f"KV cache of {self.k.shape[1]} positions is full")
        self.k[:, self.length:end], self.v[:, self.length:end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.num_kv_heads, args.head_dim)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: "torch.Tensor | DocumentLengths | None" = None
                ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(args, i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False)

    def make_block(self, args, layer_id: int) -> nn.Module:
        """Block ``layer_id``; families built on this class (e.g. MoE) override it."""
        return TransformerBlock(args)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab); chunks pass hidden states (batch, seq, dim).
        ``positions`` (batch, seq): each token's position within its document (trainer.data.documents); given,
        tokens are rotated by it and attend within their documents (trainer.models.attention)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        per_document = self.args.attn_backend == "varlen"
        # Traced for pipeline stages (torch.export), the graph is cut between blocks and a stage may not hand a
        # rotary table or mask to a later one: each block builds its own from the positions, which pass from
        # block to block (a copy each, so that every stage receives them from the one before it).
        per_block = positions is not None and torch.compiler.is_exporting()
        rope, mask = document_attention(None if per_block else positions, self.rope, h, per_document=per_document)
        for layer in self.layers.values():
            if per_block:
                positions = positions.clone()
                rope, mask = document_attention(positions, self.rope, h, per_document=per_document)
            h = layer(h, rope, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_fn(self, name: str) -> InitFn:
        """Initialiser of the parameter ``name`` (a global name, valid in any chunk)."""
        args = self.args
        parts = name.split(".")
        if name.endswith("norm.weight"):
            return constant_(1.0)
        if parts[0] == "tok_embeddings":
            # Tied: the same weight is the output projection, so give it the output's scale.
            return normal_(args.dim**-0.5, truncate=3.0) if args.tie_embeddings else normal_(1.0)
        if parts[0] == "output":
            return normal_(args.dim**-0.5, truncate=3.0)
        # Depth-scaled init for the projections that write into the residual stream.
        layer_id = int(parts[1])
        if parts[-2] in ("wo", "w2", "w3") or parts[-1] in ("w2", "w3"):  # Linear weights, or stacked experts
            return normal_(0.02 / math.sqrt(2 * (layer_id + 1)))
        return normal_(0.02)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter this (possibly partial, possibly sharded) model holds."""
        for name, param in self.named_parameters():
            if self.args.tie_embeddings:
                name = TIED_WEIGHTS.get(name, name)
            init_param_(param, name, seed, self.init_fn(name))
        self.rope = rope_table(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope.device)


def llama_flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul plus causal-free attention scores.

    The embedding lookup is not a matmul; the output projection is. Attention adds
    12 * n_layers * dim * seq_len (QK^T and AV, forward and backward), as in the PaLM paper.
    """
    kv_dim = args.num_kv_heads * args.head_dim
    attn = args.dim * (2 * args.dim + 2 * kv_dim)
    mlp = 3 * args.dim * args.ffn_hidden_dim
    matmul_params = args.n_layers * (attn + mlp) + args.dim * args.vocab_size
    return 6 * matmul_params + 12 * args.n_layers * args.dim * seq_len


def llama_activation_bytes(args: LlamaArgs, *, dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False,
                           loss_parallel: bool = False) -> ActivationBytes:
    """What autograd saves per token, counted from this module's operations (and checked against
    saved-tensor hooks in tests/unit/test_activation_memory.py).

    Per block, in the compute dtype: each RMSNorm keeps its input, the normalised input (for the
    weight's gradient) and its output (the next matmuls' input) plus one fp32 scalar; attention keeps
    the rotated q and k, v, and the output of scaled_dot_product_attention (which is also wo's input)
    plus a float32 log-sum-exp per head; SwiGLU keeps w1's and w3's outputs, silu's output and their
    product. Under TP the heads and the hidden units are split; with sequence parallelism the norms'
    tensors are split along the sequence too, but the gathered norm output that the matmuls keep is whole.
    After the blocks: the final norm and the loss's float32 log-softmax (split over the vocabulary
    under loss parallelism). Before them: the token ids (int64).
    """
    norm, attention, outer = attention_activation_bytes(
        args, dtype_bytes=dtype_bytes, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    block = 2 * norm + attention + swiglu_activation_bytes(args.ffn_hidden_dim, dtype_bytes) / tp
    return dataclasses.replace(outer, blocks=(block,) * args.n_layers)


def attention_activation_bytes(args, *, dtype_bytes: int, tp: int, sequence_parallel: bool, loss_parallel: bool,
                               qk_norm: bool = False) -> tuple[float, float, ActivationBytes]:
    """Per token: (one block norm, the attention, the parts outside the blocks as ActivationBytes with no
    blocks) of a Llama-style model (``llama_activation_bytes``). ``qk_norm``: each per-head RMSNorm of q
    and k keeps its input and normalised input plus one float32 scalar per head. Under the varlen backend the
    attention output is kept twice (per document, and concatenated as wo's input)."""
    b, d = dtype_bytes, args.dim
    heads, kv = args.n_heads * args.head_dim, args.num_kv_heads * args.head_dim
    norm_share = d / tp if sequence_parallel else d
    # a norm: input and normalised input (sequence-split under SP), output as the matmuls keep it (whole)
    norm = b * (2 * norm_share + d) + 4
    attention = b * (2 * heads + 2 * kv) / tp + 4 * args.n_heads / tp
    if args.attn_backend == "varlen":  # each document's output is kept, and their concatenation (wo's input) too
        attention += b * heads / tp
    if qk_norm:
        attention += (b * 2 * (heads + kv) + 4 * (args.n_heads + args.num_kv_heads)) / tp
    final_norm = b * 3 * norm_share + 4
    vocab = args.vocab_size / tp if loss_parallel else args.vocab_size
    # documents: the rotary table gathered at each token's position, float32 (head_dim / 2 pairs of cos, sin)
    return norm, attention, ActivationBytes(blocks=(), block_input=b * norm_share, pre=8.0, documents=4 * args.head_dim,
                                            post=final_norm + 4 * vocab + 8)


def swiglu_activation_bytes(hidden: int, dtype_bytes: int) -> float:
    """Per token (or routed row) of a SwiGLU feed-forward: w1's and w3's outputs, silu's output, their product."""
    return dtype_bytes * 4 * hidden
