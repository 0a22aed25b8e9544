"""Hugging Face names, layouts and config for the MoE family: transformers' Qwen3MoeForCausalLM.

Each of our stacked expert weights (experts, out, in) is one tensor per expert there
(``mlp.experts.<e>.gate_proj.weight``, the layout of the published Qwen 3 checkpoints). q and k
are permuted as for Llama (our rotary embedding rotates consecutive pairs), and so are the
per-head q/k norm weights. Shared experts and the load-balancing bias have no place in that
class: a model with them is refused for export when the job is planned.
"""

import re

import torch

from trainer.errors import UserError
from trainer.models.registry import HFAdapter
from trainer.models.llama import hf as llama_hf
from trainer.models.moe.args import MoEArgs

_LAYER = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}


def hf_name(name: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return llama_hf.hf_name(name)


def hf_names(name: str, args: MoEArgs) -> list[str]:
    """The HF tensors one of ours becomes: one per expert for the stacked expert weights."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _EXPERTS:
        prefix, kind = f"model.layers.{m.group(1)}.mlp.experts", _EXPERTS[m.group(2)]
        return [f"{prefix}.{e}.{kind}.weight" for e in range(args.n_experts)]
    return [hf_name(name)]


def _pairs_to_halves(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, 2).T.reshape(-1)


def _halves_to_pairs(t: torch.Tensor) -> torch.Tensor:
    return t.view(2, -1).T.reshape(-1)


def to_hf(name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return _pairs_to_halves(tensor)
    return llama_hf.to_hf(name, tensor, args)


def from_hf(name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return _halves_to_pairs(tensor)
    return llama_hf.from_hf(name, tensor, args)


def unsupported(args: MoEArgs) -> str | None:
    """Why Qwen3MoeForCausalLM cannot hold this model (None: it can)."""
    if args.n_shared_experts:
        return "n_shared_experts > 0 (Qwen 3 MoE has no shared experts)"
    if args.bias_update_speed > 0:
        return "bias_update_speed > 0 (Qwen 3 MoE has no load-balancing bias)"
    if args.score_func != "softmax" or not args.norm_topk or args.route_scale != 1.0:
        return "routing other than softmax scores, norm_topk = true and route_scale = 1.0 (Qwen 3 MoE routing)"
    if not args.qk_norm:
        return "qk_norm = false (Qwen 3 attention normalises q and k)"
    return None


def hf_config(args: MoEArgs, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": args.expert_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.n_dense_layers)),
        "router_aux_loss_coef": args.aux_loss_coef,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def from_config(config: dict, base: MoEArgs) -> dict:
    """config.json -> our args for Qwen3MoeForCausalLM, as llama's ``from_config``."""
    llama_hf._refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,),
                                     "decoder_sparse_step": (1,), "use_sliding_window": (False,)}, "moe")
    require = llama_hf.require
    dim, heads, layers = (require(config, "hidden_size"), require(config, "num_attention_heads"),
                          require(config, "num_hidden_layers"))
    dense = list(config.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise UserError(f"config.json mlp_only_layers = {dense}: the moe family has its dense blocks first"
                        " (mlp_only_layers = [0, 1, ..., n - 1])")
    head_dim = config.get("head_dim") or dim // heads
    return {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim_override": None if head_dim * heads == dim and base.head_dim_override is None else head_dim,
            "vocab_size": require(config, "vocab_size"), "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "rope_theta": llama_hf.rope_theta(config), "qk_norm": True, "n_dense_layers": len(dense),
            "dense_hidden_dim": require(config, "intermediate_size"),
            "expert_hidden_dim": require(config, "moe_intermediate_size"),
            "n_experts": require(config, "num_experts" if "num_experts" in config else "num_local_experts"),
            "top_k": require(config, "num_experts_per_tok"), "norm_topk": bool(config.get("norm_topk_prob", False)),
            "n_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0, "bias_update_speed": 0.0,
            "tie_embeddings": bool(config.get("tie_word_embeddings", False))}


class MoEHF(HFAdapter):
    model_type = "qwen3_moe"
    hf_name = staticmethod(hf_name)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    config = staticmethod(hf_config)
    names = staticmethod(hf_names)
    unsupported = staticmethod(unsupported)
    from_config = staticmethod(from_config)
