"""The shared decoder: embeddings, blocks of attention and a gated feed-forward, a final norm and the output
projection. Every built-in family is this model with its options (trainer.models.decoder.args).

The model knows nothing about parallelism. ``tok_embeddings``, ``norm`` and ``output`` may be set to None and
entries of ``layers`` deleted: that is how a pipeline chunk is made, and parameter names stay those of the whole
model. Attention rotates consecutive pairs of each head's dimensions (Meta's layout; Hugging Face checkpoints are
permuted on import and export).
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.dtensor import local_tensor
from trainer.models.attention import block_causal_mask
from trainer.models.decoder.args import DecoderArgs
from trainer.models.init import InitFn, constant_, init_param_, normal_
from trainer.models.registry import ActivationBytes

# With tie_embeddings, the output projection is the embedding matrix. A pipeline stage that
# holds only the output projection initialises it under the embedding's name, so both copies
# start equal.
TIED_WEIGHTS = {"output.weight": "tok_embeddings.weight"}


def rope_frequencies(args: DecoderArgs, *, local: bool = False, device=None) -> torch.Tensor:
    """(rope_dim / 2,) float32 angular frequencies of the rotary embedding: ``rope_theta`` with ``rope_scaling``,
    or, for a sliding-window layer with its own base (``local``), ``rope_local_theta`` unscaled."""
    dim = args.rope_dim
    theta = args.rope_local_theta if local else args.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if local or args.rope_scaling in ("none", "dynamic"):  # dynamic: plain up to the original context (validated)
        return freqs
    factor = args.rope_factor
    if args.rope_scaling == "linear":  # position interpolation: positions / factor
        return freqs / factor
    original = args.rope_original_max_seq_len
    if args.rope_scaling == "yarn":
        # The pair index at which a frequency turns ``rotations`` times over the original context.
        def pair(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair(args.rope_beta_fast), pair(args.rope_beta_slow)
        if args.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low)
                / (high - low if high != low else 0.001)).clamp(0, 1)
        return freqs / factor * ramp + freqs * (1 - ramp)
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by factor, shorter
    # than it / high_freq_factor kept, and those between interpolated smoothly.
    wavelength = 2 * math.pi / freqs
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    scaled = torch.where(wavelength > original / low, freqs / factor, freqs)
    smooth = (original / wavelength - low) / (high - low)
    between = ~(wavelength < original / high) & ~(wavelength > original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_attention_factor(args: DecoderArgs) -> float:
    """What yarn multiplies cos and sin by (1 for every other kind)."""
    if args.rope_scaling != "yarn":
        return 1.0
    if args.rope_attention_factor is not None:
        return args.rope_attention_factor
    return 0.1 * math.log(args.rope_factor) + 1.0 if args.rope_factor > 1 else 1.0


def rope_table(args: DecoderArgs, *, local: bool = False, device=None) -> torch.Tensor:
    """(max_seq_len, rope_dim // 2, 2) table of (cos, sin) for each position and frequency."""
    if torch.empty(0, device=device).is_meta:  # shape only (meta arange would import torch._dynamo)
        return torch.empty(args.max_seq_len, args.rope_dim // 2, 2, device=device)
    freqs = rope_frequencies(args, local=local, device=device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    factor = 1.0 if local else rope_attention_factor(args)
    return table * factor if factor != 1.0 else table


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


class RMSNorm(nn.RMSNorm):
    """RMSNorm whose scale is ``offset + weight`` (Gemma stores its weights around 0: offset 1), computed in
    float32 and cast back, as the published models do; offset 0 is torch's RMSNorm."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__(dim, eps=eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset:
            return super().forward(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).type_as(x)


def materialized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                           scale: float, softcap: float | None, sinks: torch.Tensor | None,
                           causal: bool) -> torch.Tensor:
    """Attention whose scores are materialised, for what no fused kernel computes: logits soft-capped
    (``softcap * tanh(logits / softcap)``, Gemma 2) and sinks (one logit per head that joins the softmax's
    denominator with no value, gpt-oss). ``mask``: additive (batch, 1, queries, keys), or boolean (queries, keys)
    of the keys each query may see (generation's cache). (batch, heads, seq, head_dim) in, the same shape out."""
    if q.shape[1] != k.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    elif causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2]
                                                                                                - q.shape[-2])
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return scores.softmax(-1, dtype=torch.float32).type_as(q) @ v
    # (batch, heads, queries, keys + 1): the sink is one more logit per row, dropped after the softmax
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores.float(), sink], dim=-1).softmax(-1)[..., :-1]
    return probs.type_as(q) @ v


class HeadSinks(nn.Module):
    """The attention sinks: one learned logit per query head (a module of its own, so that tensor parallelism
    shards it with the heads)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings and the options of ``DecoderArgs``: biases on q/k/v and on the
    output, an RMSNorm of q and k over each head or the whole projection, a softmax scale, logit soft-capping, sinks,
    a sliding window (the mask comes with the call; the window matters here only for generation's KV cache)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qk_norm: str = "none",
                 norm_eps: float = 1e-5, norm_offset: float = 0.0, bias: bool = False, scale: float | None = None,
                 softcap: float | None = None, window: int | None = None, out_bias: bool = False,
                 sinks: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=out_bias)
        self.sinks = HeadSinks(n_heads) if sinks else None
        self.qk_norm = qk_norm
        width = {"head": (head_dim, head_dim), "projection": (n_heads * head_dim, n_kv_heads * head_dim)}
        if qk_norm in width:
            self.q_norm = RMSNorm(width[qk_norm][0], norm_eps, norm_offset)
            self.k_norm = RMSNorm(width[qk_norm][1], norm_eps, norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.scale, self.softcap, self.window = scale, softcap, window
        self.kv_cache: KVCache | None = None
        """Set for generation (trainer/generate.py): keys and values of the earlier positions are kept, and
        ``x`` holds only the positions after them."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: "torch.Tensor | DocumentLengths | None" = None
                ) -> torch.Tensor:
        """``mask``: (batch, 1, queries, keys) additive mask of the keys each query may see (documents, a window),
        or each window's document lengths (attended one by one); None = causal."""
        bs, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = q.view(bs, seq, -1, self.head_dim)
        k = k.view(bs, seq, -1, self.head_dim)
        v = v.view(bs, seq, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cache = self.kv_cache
        start = 0 if cache is None else cache.length
        q, k = apply_rope(q, rope[start:]), apply_rope(k, rope[start:])
        if cache is not None:
            k, v = cache.append(k, v)
        sinks = None if self.sinks is None else local_tensor(self.sinks.weight)  # this rank's heads under TP
        out = attend(q, k, v, mask, start=start, window=self.window, scale=self.scale, softcap=self.softcap,
                     sinks=sinks, cached=cache is not None)
        return self.wo(out.reshape(bs, seq, -1))

    def make_kv_cache(self, batch: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> "KVCache":
        """An empty cache for generation of up to ``max_len`` positions (trainer/generate.py installs it)."""
        return KVCache(batch, max_len, self.wk.out_features // self.head_dim, self.head_dim, dtype=dtype,
                       device=device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | DocumentLengths | None", *,
           start: int = 0, window: int | None = None, scale: float | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None, cached: bool = False) -> torch.Tensor:
    """Attention of (batch, seq, heads, head_dim) ``q``, ``k``, ``v`` (v's head size may differ) -> (batch, seq,
    heads, v's head_dim). ``mask`` as Attention.forward takes it; ``cached``: generation with a KV cache, whose
    ``start`` earlier positions come first in ``k`` and ``v``; ``sinks``: one logit per query head (gpt-oss)."""
    seq = q.shape[1]
    if cached:
        if isinstance(mask, DocumentLengths) or (mask is not None and start == 0 and window is None):
            raise ValueError("generation with a KV cache takes one document: no mask")
        mask = cache_mask(start, seq, window, q.device)
    # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads. On CUDA, no fused kernel
    # takes both a mask and grouped heads (flash takes no mask, memory-efficient no enable_gqa), and the
    # fallback keeps every head's scores: with a mask, the kv heads are repeated instead (the CPU kernel
    # takes both).
    grouped = q.shape[2] != k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    causal = mask is None and (start == 0 or seq == 1)
    if isinstance(mask, DocumentLengths):
        out = per_document_attention(q, k, v, mask, enable_gqa=grouped, scale=scale)
    elif softcap is not None or sinks is not None:
        out = materialized_attention(q, k, v, mask, scale=scale or q.shape[-1]**-0.5, softcap=softcap, sinks=sinks,
                                     causal=causal and seq > 1)
    else:
        if grouped and mask is not None and q.is_cuda:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and seq > 1, scale=scale,
                                             enable_gqa=grouped)
    return out.transpose(1, 2)


def cache_mask(start: int, seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Generation's mask of ``seq`` new positions after ``start`` cached ones: each sees the cached positions and
    the new ones up to itself, the last ``window`` only with a sliding window. None where the plain causal kernel
    computes the same (a first chunk within the window, or one new token without a window)."""
    if (start == 0 and (window is None or seq <= window)) or (seq == 1 and (window is None or start < window)):
        return None
    query = torch.arange(start, start + seq, device=device)[:, None]
    key = torch.arange(start + seq, device=device)
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return allowed


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
                           enable_gqa: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) ``q``, ``k``, ``v`` within each document alone, causal inside
    it: the causal kernel once per document, on that document's rows only, so the cost is the sum of the
    squared document lengths, not the squared window. Splitting (rather than slicing) each window makes
    backward one concatenation per tensor instead of a zero-filled full-size gradient per document."""
    windows = []
    for qw, kw, vw, sizes in zip(q.unbind(0), k.unbind(0), v.unbind(0), lengths.per_window, strict=True):
        parts = [F.scaled_dot_product_attention(a[None], b[None], c[None], is_causal=True, scale=scale,
                                                enable_gqa=enable_gqa)
                 for a, b, c in zip(qw.split(sizes, dim=1), kw.split(sizes, dim=1), vw.split(sizes, dim=1))]
        windows.append(torch.cat(parts, dim=2)[0])
    return torch.stack(windows)


def document_attention(positions: torch.Tensor | None, table: torch.Tensor, hidden: torch.Tensor, *,
                       per_document: bool = False, window: int | None = None
                       ) -> tuple[torch.Tensor, "torch.Tensor | DocumentLengths | None"]:
    """(rotary table, attention mask) for tokens at ``positions`` (batch, seq) within their documents, built
    once per forward and shared by the layers of one kind: the table gathered at each token's position, (batch,
    seq, head_dim / 2, 2), and the additive block-causal mask (trainer.models.attention.block_causal_mask, with the
    layers' sliding ``window``) in the dtype attention computes in: autocast's, else ``hidden``'s. No value is
    read back from the device: whether a batch needs a mask at all is decided on the host, where the tokens are
    (trainer.data.documents.model_inputs gives no ``positions`` for a batch in which every window is one
    document, and that batch keeps the causal kernel and the table as it is; with a sliding window shorter than
    the sequence it still needs a mask). With ``per_document`` (the varlen backend, CPU only), instead of the
    mask: each window's document lengths (``DocumentLengths``), read from ``positions`` on the host."""
    seq = hidden.shape[1]
    if positions is None:
        if window is None or seq <= window:
            return table, None
        positions = torch.arange(seq, device=hidden.device)[None]
        gather = False
    else:
        gather = True
    if per_document:
        return table[positions], DocumentLengths.of(positions)
    device = hidden.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    return table[positions] if gather else table, block_causal_mask(positions, dtype, window)


class KVCache:
    """One attention layer's keys and values of the positions generated so far, in buffers of ``max_len``."""

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device, v_dim: int | None = None):
        self.k = torch.empty(batch, max_len, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(batch, max_len, kv_heads, v_dim or head_dim, dtype=dtype, device=device)
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
    """A gated feed-forward: w2(act(w1 x) * w3 x), SwiGLU (silu) or GeGLU (tanh-approximated gelu)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))


def attention_of(args: DecoderArgs, layer_id: int, *, qk_norm: str | None = None) -> Attention:
    """Block ``layer_id``'s attention as ``args`` describe it."""
    return Attention(args.dim, args.n_heads, args.num_kv_heads, args.head_dim,
                     qk_norm=args.qk_norm if qk_norm is None else qk_norm, norm_eps=args.norm_eps,
                     norm_offset=args.norm_offset, bias=args.qkv_bias, scale=args.attn_scale,
                     softcap=args.attn_softcap or None, window=args.window(layer_id), out_bias=args.attn_out_bias,
                     sinks=args.attn_sinks)


class TransformerBlock(nn.Module):
    """Attention and a feed-forward, each with its norms where ``norm_placement`` puts them: before the branch
    (``attention_norm``, ``ffn_norm``), after it (``attention_out_norm``, ``ffn_out_norm``) or both."""

    def __init__(self, args: DecoderArgs, layer_id: int, ffn: nn.Module | None = None, *,
                 ffn_name: str = "feed_forward", qk_norm: str | None = None, attention: nn.Module | None = None):
        super().__init__()
        norm = lambda: RMSNorm(args.dim, args.norm_eps, args.norm_offset)  # noqa: E731
        pre, post = args.norm_placement in ("pre", "sandwich"), args.norm_placement in ("post", "sandwich")
        self.kind = (args.window(layer_id), args.local_rope(layer_id))
        """Which rotary table and mask the block takes: (sliding window or None, local rotary base)."""
        self.attention_norm = norm() if pre else None
        # a family's own attention (latent attention: the MoE model's blocks), else the decoder's
        self.attention = attention if attention is not None else attention_of(args, layer_id, qk_norm=qk_norm)
        self.attention_out_norm = norm() if post else None
        self.ffn_norm = norm() if pre else None
        self.ffn_name = ffn_name
        # Blocks name their feed-forward by kind (dense ``feed_forward``, mixture-of-experts ``moe``), so that the TP
        # plan and the HF mapping can tell them apart by name.
        setattr(self, ffn_name, ffn if ffn is not None else FeedForward(args.dim, args.ffn_hidden_dim,
                                                                        args.activation))
        self.ffn_out_norm = norm() if post else None
        self.residual_scale = args.residual_scale

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: "torch.Tensor | DocumentLengths | None" = None
                ) -> torch.Tensor:
        a = self.attention(self.attention_norm(x) if self.attention_norm is not None else x, rope, mask=mask)
        if self.attention_out_norm is not None:
            a = self.attention_out_norm(a)
        h = x + (a * self.residual_scale if self.residual_scale != 1.0 else a)
        f = getattr(self, self.ffn_name)(self.ffn_norm(h) if self.ffn_norm is not None else h)
        if self.ffn_out_norm is not None:
            f = self.ffn_out_norm(f)
        return h + (f * self.residual_scale if self.residual_scale != 1.0 else f)


class Transformer(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)
        if args.rope_local_theta is not None:
            self.register_buffer("rope_local", rope_table(args, local=True), persistent=False)

    def make_block(self, args, layer_id: int) -> nn.Module:
        """Block ``layer_id``; families built on this class (e.g. MoE) override it."""
        return TransformerBlock(args, layer_id)

    def _attention_inputs(self, kind: tuple, positions: torch.Tensor | None, hidden: torch.Tensor):
        window, local = kind
        return document_attention(positions, self.rope_local if local else self.rope, hidden, window=window,
                                  per_document=self.args.attn_backend == "varlen")

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab); chunks pass hidden states (batch, seq, dim).
        ``positions`` (batch, seq): each token's position within its document (trainer.data.documents); given,
        tokens are rotated by it and attend within their documents (trainer.models.attention)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.args.embedding_scale != 1.0:  # in the activations' dtype, as the published models round it
                h = h * torch.tensor(self.args.embedding_scale, dtype=h.dtype)
        else:
            h = x
        # Traced for pipeline stages (torch.export), the graph is cut between blocks and a stage may not hand a
        # rotary table or mask to a later one: each block builds its own from the positions, which pass from
        # block to block (a copy each, so that every stage receives them from the one before it).
        per_block = positions is not None and torch.compiler.is_exporting()
        inputs = {}  # per kind of block: (rotary table, mask), built once per forward
        for layer in self.layers.values():
            if per_block:
                positions = positions.clone()
                rope, mask = self._attention_inputs(layer.kind, positions, h)
            else:
                if layer.kind not in inputs:
                    inputs[layer.kind] = self._attention_inputs(layer.kind, positions, h)
                rope, mask = inputs[layer.kind]
            h = layer(h, rope, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        logits = self.output(h)
        if self.args.logit_scale != 1.0:
            logits = logits * self.args.logit_scale
        if self.args.final_softcap:
            logits = self.args.final_softcap * torch.tanh(logits / self.args.final_softcap)
        return logits

    def init_fn(self, name: str) -> InitFn:
        """Initialiser of the parameter ``name`` (a global name, valid in any chunk)."""
        args = self.args
        parts = name.split(".")
        if name.endswith("norm.weight"):
            return constant_(1.0 - args.norm_offset)  # a scale of 1 either way
        if name.endswith((".bias", "_bias")):  # nn.Linear's, and stacked experts' (w1_bias...)
            return constant_(0.0)
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
        self.rope = rope_table(self.args, device=self.rope.device)
        if self.args.rope_local_theta is not None:
            self.rope_local = rope_table(self.args, local=True, device=self.rope_local.device)


def attention_flops(args: DecoderArgs, seq_len: int) -> float:
    """Training FLOPs per token of the attention scores (QK^T and AV, forward and backward, as in the PaLM
    paper): 6 * (q/k head size + v head size) * n_heads * keys per layer, with a sliding window's keys capped at the
    window."""
    keys = sum(min(seq_len, args.window(i) or seq_len) for i in range(args.n_layers))
    v_dim = args.v_head_dim if args.kv_lora_rank else args.head_dim
    return 6 * args.n_heads * (args.head_dim + v_dim) * keys


def attention_params(args: DecoderArgs) -> int:
    """Matmul weights of one block's attention (every token uses all of them)."""
    if args.kv_lora_rank:  # latent attention (trainer/models/mla.py): low-rank q and kv, then per head
        heads, qk = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        q = (args.dim * args.q_lora_rank + args.q_lora_rank * heads * qk if args.q_lora_rank
             else args.dim * heads * qk)
        kv = (args.dim * (args.kv_lora_rank + args.qk_rope_head_dim)
              + args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim))
        return q + kv + heads * args.v_head_dim * args.dim
    return args.dim * (2 * args.n_heads * args.head_dim + 2 * args.num_kv_heads * args.head_dim)


def decoder_flops_per_token(args: DecoderArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul plus the attention scores.

    The embedding lookup is not a matmul; the output projection is."""
    mlp = 3 * args.dim * args.ffn_hidden_dim
    matmul_params = args.n_layers * (attention_params(args) + mlp) + args.dim * args.vocab_size
    return 6 * matmul_params + attention_flops(args, seq_len)


def decoder_activation_bytes(args: DecoderArgs, *, dtype_bytes: int, tp: int = 1, sequence_parallel: bool = False,
                             loss_parallel: bool = False) -> ActivationBytes | str:
    """What autograd saves per token, counted from this module's operations (and checked against
    saved-tensor hooks in tests/unit/test_activation_memory.py).

    Per block, in the compute dtype: each RMSNorm keeps its input, the normalised input (for the
    weight's gradient) and its output (the next matmuls' input) plus one fp32 scalar; attention keeps
    the rotated q and k, v, and the output of scaled_dot_product_attention (which is also wo's input)
    plus a float32 log-sum-exp per head; SwiGLU keeps w1's and w3's outputs, silu's output and their
    product. Under TP the heads and the hidden units are split; with sequence parallelism the norms'
    tensors are split along the sequence too, but the gathered norm output that the matmuls keep is whole.
    After the blocks: the final norm and the loss's float32 log-softmax (split over the vocabulary
    under loss parallelism). Before them: the token ids (int64). The options that change what is kept
    (post-branch norms, a norm of the whole q/k projection, soft-capped attention logits, offset norms,
    GeGLU, scaled embeddings, residuals or logits) are not modelled."""
    unmodelled = [name for name, on in (
        ("latent attention", bool(args.kv_lora_rank)),
        ("norms after the branches", args.norm_placement != "pre"), ("q/k norm over the projection",
                                                                      args.qk_norm == "projection"),
        ("soft-capped attention logits", bool(args.attn_softcap)), ("attention sinks", args.attn_sinks),
        ("offset norms", args.norm_offset != 0),
        ("GeGLU", args.activation != "silu"), ("scaled embeddings, residuals or logits",
                                               (args.embedding_scale, args.residual_scale, args.logit_scale)
                                               != (1.0, 1.0, 1.0)),
        ("soft-capped logits", bool(args.final_softcap))) if on]
    if unmodelled:
        return "not modelled for " + ", ".join(unmodelled)
    norm, attention, outer = attention_activation_bytes(
        args, dtype_bytes=dtype_bytes, tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
        qk_norm=args.qk_norm == "head")
    block = 2 * norm + attention + swiglu_activation_bytes(args.ffn_hidden_dim, dtype_bytes) / tp
    return dataclasses.replace(outer, blocks=(block,) * args.n_layers)


def attention_activation_bytes(args, *, dtype_bytes: int, tp: int, sequence_parallel: bool, loss_parallel: bool,
                               qk_norm: bool = False) -> tuple[float, float, ActivationBytes]:
    """Per token: (one block norm, the attention, the parts outside the blocks as ActivationBytes with no
    blocks) of a decoder (``decoder_activation_bytes``). ``qk_norm``: each per-head RMSNorm of q
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
