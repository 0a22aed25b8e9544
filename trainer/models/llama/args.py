"""Llama 3 hyper-parameters and the presets selectable as ``[model] flavor``."""

import math
from dataclasses import dataclass

from trainer.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192  # length of the rotary table; set to [training] seq_len at build
    tie_embeddings: bool = False
    attn_backend: str = "sdpa"  # [model] attn_backend: "varlen" attends document by document (block-causal, CPU)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


MAX_SIZE = 2**31 - 1  # any one dimension
MAX_LAYERS = 10_000


def validate_llama_args(a: LlamaArgs) -> None:
    """One-line errors for args that cannot build a working Llama, naming the override key."""

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"[model.overrides] {key}={getattr(a, key)!r}: {why}")

    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"):
        if getattr(a, key) < 1:
            raise bad(key, "must be >= 1")
    if a.n_kv_heads is not None and a.n_kv_heads < 1:
        raise bad("n_kv_heads", "must be >= 1 (or unset for n_heads)")
    # Ceilings far above any real model, so that an absurd value is one line here rather than an
    # overflow inside torch or a model build that never ends (the memory check then judges sizes).
    for key in ("dim", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
        if (getattr(a, key) or 0) > MAX_SIZE:
            raise bad(key, f"must be <= {MAX_SIZE}")
    if a.n_layers > MAX_LAYERS:
        raise bad("n_layers", f"must be <= {MAX_LAYERS} (the largest published dense models have under 200)")
    for key in ("ffn_dim_multiplier", "norm_eps", "rope_theta"):
        if getattr(a, key) is not None and not math.isfinite(getattr(a, key)):
            raise bad(key, "must be a finite number")
    if a.dim % a.n_heads:
        raise bad("n_heads", f"must divide dim={a.dim}")
    if (a.dim // a.n_heads) % 2:
        raise bad("n_heads", f"the head size dim / n_heads = {a.dim // a.n_heads} must be even (rotary embeddings)")
    if a.n_heads % a.num_kv_heads:
        raise bad("n_kv_heads", f"must divide n_heads={a.n_heads} (grouped-query attention)")
    if a.ffn_dim_multiplier is not None and a.ffn_dim_multiplier <= 0:
        raise bad("ffn_dim_multiplier", "must be > 0")
    if (a.ffn_dim_multiplier or 1.0) * 8 * a.dim / 3 > MAX_SIZE:
        raise bad("ffn_dim_multiplier" if a.ffn_dim_multiplier else "dim",
                  f"the feed-forward size (ffn_dim_multiplier * 8/3 * dim) must be <= {MAX_SIZE}")
    for key in ("norm_eps", "rope_theta"):
        if not getattr(a, key) > 0:
            raise bad(key, "must be > 0")


FLAVORS = {
    # Tiny: trains in seconds on one CPU core. Vocabulary matches the bundled tokenizer cut to 2046 ranks.
    "debugmodel": LlamaArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=64),
    # Smallest real-vocabulary shape; big enough for compute to dominate on CPU benchmarks.
    "270M": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256),
    # Llama 3.2 1B and 3B tie their embeddings, as the released models do.
    "1B": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, tie_embeddings=True
    ),
    "3B": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256, tie_embeddings=True
    ),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
}
