"""The options of the shared decoder: every family built on it (Llama, Qwen, Mistral, OLMo, Gemma, Granite, the
mixture-of-experts family) is a choice of these, made by its flavors and by its config.json mapping.

The defaults are Llama 3's: pre-norm RMSNorm, SwiGLU, grouped-query attention without biases, plain rotary
embeddings, untied. Each option names what it changes and which published families use it.
"""

import math
from dataclasses import dataclass
from typing import Literal

from trainer.errors import ConfigError

RopeScaling = Literal["none", "llama3", "linear", "dynamic", "yarn"]


@dataclass(frozen=True, kw_only=True)
class DecoderArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    head_dim_override: int | None = None  # None = dim // n_heads (Qwen 3, Gemma, Mistral set their own)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    ffn_hidden_override: int | None = None  # the feed-forward's hidden size as given (config.json intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192  # length of the rotary table; set to [training] seq_len at build
    tie_embeddings: bool = False
    attn_backend: str = "sdpa"  # [model] attn_backend: "varlen" attends document by document (block-causal, CPU)
    # -- attention ------------------------------------------------------------------------------------------
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen 2)
    attn_out_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    attn_sinks: bool = False
    """A learned logit per head that joins each query's softmax denominator and carries no value (gpt-oss): a query
    may give less than all of its attention to the keys. The scores are materialised (no fused kernel takes it)."""
    qk_norm: Literal["none", "head", "projection"] = "none"
    """RMSNorm of q and k: over each head (Qwen 3, Gemma 3) or over the whole projection (OLMo 2)."""
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # attention logits -> softcap * tanh(logits / softcap) (Gemma 2); 0 = none
    sliding_window: int = 0  # a query sees at most this many keys, itself included (Mistral, Gemma); 0 = all
    global_every: int = 0
    """With a sliding window: 0 = every layer slides; N = every N-th layer (N-1, 2N-1, ...) attends in full (Gemma 2:
    2, Gemma 3: 6)."""
    # -- multi-head latent attention (DeepSeek-V2/V3; trainer/models/mla.py), on when kv_lora_rank > 0 -----------
    # Keys and values come from one shared latent of kv_lora_rank per token (plus a rotary key of qk_rope_head_dim
    # shared by every head); queries through a latent of q_lora_rank (0: one full projection). Each head's query
    # and key are qk_nope_head_dim unrotated dimensions then qk_rope_head_dim rotated ones; its value v_head_dim.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # -- rotary embeddings ----------------------------------------------------------------------------------
    rope_scaling: RopeScaling = "none"
    """Llama 3.1's "llama3", "linear" (position interpolation), "dynamic" (NTK), "yarn" (DeepSeek-V3, gpt-oss)."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context the scaled model was first trained at
    # yarn: frequencies blend from kept (beyond beta_fast rotations over the original context) to divided by the
    # factor (below beta_slow); cos and sin are multiplied by the attention factor (None: 0.1 ln(factor) + 1).
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    rope_truncate: bool = True  # the blend's bounds rounded outwards to whole dimensions (gpt-oss: false)
    rope_local_theta: float | None = None  # sliding-window layers' rotary base, unscaled (Gemma 3: 10,000)
    # -- norms, feed-forward, embeddings, output ------------------------------------------------------------
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """pre: x + f(norm(x)); post: x + norm(f(x)) (OLMo 2); sandwich: x + norm(f(norm(x))) (Gemma)."""
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma stores weights around 0 (offset 1)
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the gated feed-forward's gate: SwiGLU or GeGLU (Gemma)
    embedding_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(dim); Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each block's branches multiplied by this before the residual add (Granite)
    logit_scale: float = 1.0  # logits multiplied by this (Granite: 1 / logits_scaling)
    final_softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap) (Gemma 2); 0 = none

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head that rotary embeddings rotate (all of them, or latent attention's rope part)."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_hidden_override is not None:
            return self.ffn_hidden_override
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def window(self, layer_id: int) -> int | None:
        """The sliding window of block ``layer_id`` (None: it attends to every earlier key)."""
        if not self.sliding_window or (self.global_every and (layer_id + 1) % self.global_every == 0):
            return None
        return self.sliding_window

    def local_rope(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` rotates by the sliding layers' own table (``rope_local_theta``)."""
        return self.rope_local_theta is not None and self.window(layer_id) is not None


MAX_SIZE = 2**31 - 1  # any one dimension
MAX_LAYERS = 10_000


def validate_decoder_args(a: DecoderArgs) -> None:
    """One-line errors for args that cannot build a working decoder, naming the override key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"[model.overrides] {key}={getattr(a, key)!r}: {why}")

    for key, choices in (("qk_norm", ("none", "head", "projection")), ("norm_placement", ("pre", "post", "sandwich")),
                         ("activation", ("silu", "gelu_tanh")), ("rope_scaling", ("none", "llama3", "linear",
                                                                                   "dynamic", "yarn"))):
        if getattr(a, key) not in choices:
            raise bad(key, f"must be one of {', '.join(repr(c) for c in choices)}")
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"):
        if getattr(a, key) < 1:
            raise bad(key, "must be >= 1")
    for key in ("n_kv_heads", "head_dim_override", "ffn_hidden_override"):
        if getattr(a, key) is not None and getattr(a, key) < 1:
            raise bad(key, "must be >= 1 (or unset)")
    if a.sliding_window < 0:
        raise bad("sliding_window", "must be >= 0 (0 = no window)")
    # Ceilings far above any real model, so that an absurd value is one line here rather than an
    # overflow inside torch or a model build that never ends (the memory check then judges sizes).
    for key in ("dim", "n_heads", "n_kv_heads", "head_dim_override", "vocab_size", "multiple_of", "max_seq_len",
                "ffn_hidden_override", "sliding_window", "rope_original_max_seq_len"):
        if (getattr(a, key) or 0) > MAX_SIZE:
            raise bad(key, f"must be <= {MAX_SIZE}")
    if a.n_layers > MAX_LAYERS:
        raise bad("n_layers", f"must be <= {MAX_LAYERS} (the largest published dense models have under 200)")
    for key in ("ffn_dim_multiplier", "norm_eps", "rope_theta", "attn_scale", "attn_softcap", "rope_factor",
                "rope_low_freq_factor", "rope_high_freq_factor", "rope_local_theta", "rope_beta_fast", "rope_beta_slow",
                "rope_attention_factor", "norm_offset", "embedding_scale",
                "residual_scale", "logit_scale", "final_softcap"):
        if getattr(a, key) is not None and not math.isfinite(getattr(a, key)):
            raise bad(key, "must be a finite number")
    for key in ("norm_eps", "rope_theta", "attn_scale", "rope_factor", "rope_local_theta", "rope_attention_factor",
                "embedding_scale", "residual_scale", "logit_scale", "ffn_dim_multiplier"):
        if getattr(a, key) is not None and not getattr(a, key) > 0:
            raise bad(key, "must be > 0")
    for key in ("attn_softcap", "final_softcap"):
        if getattr(a, key) < 0:
            raise bad(key, "must be >= 0 (0 = none)")
    if a.head_dim_override is None and a.dim % a.n_heads:
        raise bad("n_heads", f"must divide dim={a.dim} (or set head_dim_override)")
    if a.kv_lora_rank:
        validate_latent_args(a, bad)
    elif a.head_dim % 2:
        raise bad("head_dim_override" if a.head_dim_override is not None else "n_heads",
                  f"the head size {a.head_dim} must be even (rotary embeddings)")
    if a.n_heads % a.num_kv_heads and not a.kv_lora_rank:
        raise bad("n_kv_heads", f"must divide n_heads={a.n_heads} (grouped-query attention)")
    if (a.ffn_dim_multiplier or 1.0) * 8 * a.dim / 3 > MAX_SIZE:
        raise bad("ffn_dim_multiplier" if a.ffn_dim_multiplier else "dim",
                  f"the feed-forward size (ffn_dim_multiplier * 8/3 * dim) must be <= {MAX_SIZE}")
    if a.global_every < 0:
        raise bad("global_every", "must be >= 0")
    if a.rope_scaling == "llama3" and not a.rope_high_freq_factor > a.rope_low_freq_factor:
        raise bad("rope_high_freq_factor", f"must be > rope_low_freq_factor={a.rope_low_freq_factor} (llama3 scaling)")
    if a.rope_scaling == "yarn" and not a.rope_beta_fast > a.rope_beta_slow > 0:
        raise bad("rope_beta_fast", f"must be > rope_beta_slow={a.rope_beta_slow} > 0 (yarn scaling)")
    if a.attn_backend == "varlen" and (a.sliding_window or a.attn_softcap or a.attn_sinks):
        raise ConfigError('[model] attn_backend = "varlen": this model has '
                          + ("a sliding window" if a.sliding_window else "attention logit soft-capping"
                             if a.attn_softcap else "attention sinks")
                          + ', which attending each document alone with the causal kernel does not compute;'
                            ' use attn_backend = "sdpa"')


def validate_latent_args(a: DecoderArgs, bad) -> None:
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not 0 <= getattr(a, key) <= MAX_SIZE:
            raise bad(key, f"must be between 0 and {MAX_SIZE}")
    for key in ("qk_rope_head_dim", "v_head_dim"):
        if getattr(a, key) < 1:
            raise bad(key, "must be >= 1 with latent attention (kv_lora_rank > 0)")
    if a.qk_rope_head_dim % 2:
        raise bad("qk_rope_head_dim", "must be even (rotary embeddings rotate pairs)")
    if a.head_dim != a.qk_nope_head_dim + a.qk_rope_head_dim:
        raise bad("head_dim_override", f"must be qk_nope_head_dim + qk_rope_head_dim = "
                                       f"{a.qk_nope_head_dim + a.qk_rope_head_dim} with latent attention (the query"
                                       " and key head size)")
    if a.num_kv_heads != a.n_heads:
        raise bad("n_kv_heads", f"must be n_heads={a.n_heads} with latent attention (every head has its keys)")
    if a.qkv_bias or a.qk_norm != "none" or a.attn_softcap or a.sliding_window:
        raise ConfigError("[model.overrides] kv_lora_rank: latent attention takes no qkv_bias, qk_norm, attn_softcap"
                          " or sliding_window")
