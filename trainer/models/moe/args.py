"""Mixture-of-experts decoder hyper-parameters and the presets selectable as ``[model] flavor``: the shared decoder's
options (trainer.models.decoder.args) and the experts'."""

import math
from dataclasses import dataclass
from typing import Literal

from trainer.errors import ConfigError
from trainer.models.decoder.args import MAX_SIZE, DecoderArgs, validate_decoder_args


@dataclass(frozen=True, kw_only=True)
class MoEArgs(DecoderArgs):
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qk_norm: Literal["none", "head", "projection"] = "head"  # RMSNorm over each head of q and k (Qwen 3)
    # Feed-forward: the first n_dense_layers blocks are dense SwiGLU of dense_hidden_dim; the rest are MoE.
    n_dense_layers: int = 0
    dense_hidden_dim: int = 6144
    n_experts: int = 128
    top_k: int = 8
    expert_hidden_dim: int = 768
    n_shared_experts: int = 0  # always-on SwiGLU experts of expert_hidden_dim each (DeepSeek), fused into one
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # Grouped top-k (DeepSeek-V3): the experts form n_expert_groups equal groups, each scored by the sum of its two
    # best (biased) scores; a token chooses only among the experts of its topk_groups best groups.
    n_expert_groups: int = 1
    topk_groups: int = 1
    norm_topk: bool = True  # the k chosen weights are renormalised to sum to 1
    route_scale: float = 1.0  # the chosen weights are multiplied by this
    router_bias: bool = False  # the router's logits have a learned bias (gpt-oss)
    # Experts: biases on each expert's gate, up and down projections (gpt-oss); the activation SwiGLU
    # (silu(gate) * up) or gpt-oss's clamped one: gate clamped above at swiglu_limit, up to [-limit, limit],
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1).
    expert_biases: bool = False
    expert_activation: Literal["swiglu", "swiglu_clamped"] = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Load balancing. bias_update_speed > 0: the auxiliary-loss-free method (DeepSeek-V3): each expert has a
    # bias added to its score for choosing only, moved by this much per step towards equal load.
    # aux_loss_coef > 0: a sequence-wise balance loss of this weight is added to the training objective.
    bias_update_speed: float = 0.0
    expert_bias: bool = False  # keep the per-expert choosing bias even when bias_update_speed = 0 (an imported one)
    aux_loss_coef: float = 0.0
    # Expert compute: torch._grouped_mm (all experts in one kernel per projection) where it runs, on CUDA in bf16;
    # false = one matmul chain per expert everywhere (the path every other device and dtype takes).
    use_grouped_mm: bool = True

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


def validate_moe_args(a: MoEArgs) -> None:
    """One-line errors for args that cannot build a working model, naming the override key."""
    validate_decoder_args(a)

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"[model.overrides] {key}={getattr(a, key)!r}: {why}")

    for key in ("n_experts", "top_k", "expert_hidden_dim"):
        if getattr(a, key) < 1:
            raise bad(key, "must be >= 1")
    for key in ("n_dense_layers", "n_shared_experts"):
        if getattr(a, key) < 0:
            raise bad(key, "must be >= 0")
    if a.n_dense_layers >= a.n_layers:
        raise bad("n_dense_layers", f"must be < n_layers={a.n_layers}: at least one block must be a mixture of experts"
                                    " (a dense model is the llama family)")
    for key, ceiling in (("route_scale", 100.0), ("aux_loss_coef", 100.0), ("bias_update_speed", 1.0)):
        if getattr(a, key) > ceiling:
            raise bad(key, f"must be <= {ceiling:g}")
    if a.n_dense_layers and a.dense_hidden_dim < 1:
        raise bad("dense_hidden_dim", "must be >= 1 when n_dense_layers > 0")
    for key in ("n_experts", "expert_hidden_dim", "dense_hidden_dim", "n_shared_experts"):
        if (getattr(a, key) or 0) > MAX_SIZE:
            raise bad(key, f"must be <= {MAX_SIZE}")
    for key in ("route_scale", "bias_update_speed", "aux_loss_coef"):
        if not math.isfinite(getattr(a, key)):
            raise bad(key, "must be a finite number")
    if not a.route_scale > 0:
        raise bad("route_scale", "must be > 0")
    for key in ("bias_update_speed", "aux_loss_coef"):
        if getattr(a, key) < 0:
            raise bad(key, "must be >= 0 (0 = off)")
    if a.top_k > a.n_experts:
        raise bad("top_k", f"must be <= n_experts={a.n_experts}")
    if a.n_expert_groups < 1 or a.n_experts % a.n_expert_groups:
        raise bad("n_expert_groups", f"must divide n_experts={a.n_experts}")
    if a.n_expert_groups > 1 and a.n_experts // a.n_expert_groups < 2:
        raise bad("n_expert_groups", f"must leave at least 2 experts per group (n_experts={a.n_experts}): a group is"
                                     " scored by its two best experts")
    if not 1 <= a.topk_groups <= a.n_expert_groups:
        raise bad("topk_groups", f"must be between 1 and n_expert_groups={a.n_expert_groups}")
    if a.top_k > a.topk_groups * (a.n_experts // a.n_expert_groups):
        raise bad("top_k", f"must be <= the experts of topk_groups={a.topk_groups} groups"
                           f" ({a.topk_groups * (a.n_experts // a.n_expert_groups)})")
    if a.score_func not in ("softmax", "sigmoid"):
        raise bad("score_func", "must be 'softmax' or 'sigmoid'")
    if a.expert_activation not in ("swiglu", "swiglu_clamped"):
        raise bad("expert_activation", "must be 'swiglu' or 'swiglu_clamped'")
    for key in ("swiglu_limit", "swiglu_alpha"):
        if not (math.isfinite(getattr(a, key)) and getattr(a, key) > 0):
            raise bad(key, "must be a finite number > 0")


FLAVORS = {
    # Tiny, trains in seconds on CPU: 8 experts, 2 chosen per token, the first block dense.
    "debugmodel": MoEArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=2048, n_dense_layers=1,
                          dense_hidden_dim=512, n_experts=8, top_k=2, expert_hidden_dim=128),
    # DeepSeek-V3-style routing at debug size: sigmoid scores, one shared expert, bias-based load balancing.
    "debugmodel_shared": MoEArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=2048, n_dense_layers=1,
                                 dense_hidden_dim=512, n_experts=8, top_k=2, expert_hidden_dim=128,
                                 n_shared_experts=1, score_func="sigmoid", route_scale=2.5, qk_norm="none",
                                 bias_update_speed=1e-3),
    # The released Qwen 3 MoE shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
    "qwen3-30b-a3b": MoEArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim_override=128,
                             n_experts=128, top_k=8, expert_hidden_dim=768, dense_hidden_dim=6144),
    "qwen3-235b-a22b": MoEArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim_override=128,
                               n_experts=128, top_k=8, expert_hidden_dim=1536, dense_hidden_dim=12288),
}
