"""Multi-head latent attention (DeepSeek-V2/V3): the shared decoder's attention when ``kv_lora_rank > 0``.

Every token's keys and values come from one latent of ``kv_lora_rank`` (normalised, then expanded per head by
``wkv_b``) and one rotary key of ``qk_rope_head_dim`` that all heads share; queries come through a latent of
``q_lora_rank`` (``wq_a``, a norm ``q_a_norm``, ``wq_b``) or one projection ``wq``. A head's query and key are
``qk_nope_head_dim`` unrotated dimensions followed by ``qk_rope_head_dim`` rotated ones (consecutive pairs, as
``apply_rope`` rotates them); its value has ``v_head_dim``. Generation caches the latent and the rotary key, not the
expanded keys and values.

Under tensor parallelism (trainer/models/mla_tp.py) the heads are split (``wq``/``wq_b`` and ``wkv_b`` by
column, ``wo`` by row) and the low-rank projections and their norms are replicated.
"""

import torch
from torch import nn

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.model import KVCache, RMSNorm, apply_rope, attend

# The latent paths' norms have their own epsilon, not rms_norm_eps (DeepSeek's code and transformers' class).
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        dim, heads = args.dim, args.n_heads
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk = self.nope + self.rope_dim
        if args.q_lora_rank:
            self.wq, self.wq_a = None, nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq, self.wq_a, self.q_a_norm, self.wq_b = nn.Linear(dim, heads * qk, bias=False), None, None, None
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)
        self.scale = args.attn_scale  # None: qk ** -0.5 (the DeepSeek mapping sets yarn's mscale into it)
        self.kv_cache: KVCache | None = None
        """Set for generation: the latent (as ``k``, one head) and the rotated shared key (as ``v``) of the earlier
        positions; ``x`` holds only the positions after them."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        """As the decoder's Attention.forward: ``rope`` the rotary table of ``rope_dim``, ``mask`` the same kinds."""
        bs, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q_nope, q_pe = q.view(bs, seq, -1, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cache = self.kv_cache
        start = 0 if cache is None else cache.length
        q_pe = apply_rope(q_pe, rope[start:])
        k_pe = apply_rope(k_pe.unsqueeze(2), rope[start:])  # (batch, seq, 1, rope_dim): one key for every head
        latent = self.kv_a_norm(latent).unsqueeze(2)
        if cache is not None:
            latent, k_pe = cache.append(latent, k_pe)
        kv = self.wkv_b(latent.squeeze(2))
        k_nope, v = kv.view(*kv.shape[:2], -1, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = attend(q, k, v, mask, start=start, scale=self.scale, cached=cache is not None)
        return self.wo(out.reshape(bs, seq, -1))

    def make_kv_cache(self, batch: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(batch, max_len, 1, self.kv_lora_rank, v_dim=self.rope_dim, dtype=dtype, device=device)

