"""Hugging Face names, layouts and config for the MoE family: transformers' Qwen3MoeForCausalLM.

Each of our stacked expert weights (experts, out, in) is one tensor per expert there
(``mlp.experts.<e>.gate_proj.weight``, the layout of the published Qwen 3 checkpoints). q and k
are permuted as for every decoder family (our rotary embedding rotates consecutive pairs), and so are
the per-head q/k norm weights. Shared experts and the load-balancing bias have no place in that
class: a model with them is refused for export when the job is planned.
"""

import re
from dataclasses import dataclass, field

from trainer.errors import UserError
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, require, rope_args
from trainer.models.moe.args import MoEArgs

_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}


def experts_beyond(args: MoEArgs, architecture: str, holds: tuple[str, ...] = ()) -> str | None:
    """The router and expert options (gpt-oss's, DeepSeek-V3's) that ``architecture``, a plain SwiGLU mixture with
    ungrouped routing, cannot hold (those in ``holds`` it can)."""
    extra = [f"{k} = {getattr(args, k)!r}" for k, default in (
        ("router_bias", False), ("expert_biases", False), ("expert_activation", "swiglu"), ("n_expert_groups", 1),
        ("expert_bias", False)) if k not in holds and getattr(args, k) != default]
    return f"{', '.join(extra)} ({architecture} has no such option)" if extra else None


def unsupported(args: MoEArgs) -> str | None:
    """Why Qwen3MoeForCausalLM cannot hold this model (None: it can)."""
    if why := experts_beyond(args, "Qwen3MoeForCausalLM"):
        return why
    if args.n_shared_experts:
        return "n_shared_experts > 0 (Qwen 3 MoE has no shared experts)"
    if args.bias_update_speed > 0 or args.expert_bias:
        return "bias_update_speed > 0 or expert_bias = true (Qwen 3 MoE has no load-balancing bias)"
    if args.n_expert_groups > 1:
        return "n_expert_groups > 1 (Qwen 3 MoE routes over all experts)"
    if args.score_func != "softmax" or not args.norm_topk or args.route_scale != 1.0:
        return "routing other than softmax scores, norm_topk = true and route_scale = 1.0 (Qwen 3 MoE routing)"
    if args.qk_norm != "head":
        return "qk_norm other than 'head' (Qwen 3 attention normalises q and k per head)"
    return beyond(args, "Qwen3MoeForCausalLM", {"qk_norm"})


def hf_config(args: MoEArgs) -> dict:
    return {
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": args.expert_hidden_dim,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.n_dense_layers)),
        "router_aux_loss_coef": args.aux_loss_coef,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
    }


def from_config(config: dict, base: MoEArgs) -> dict:
    """config.json -> our args for Qwen3MoeForCausalLM, as the dense families' ``from_config``."""
    refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,), "decoder_sparse_step": (1,),
                           "use_sliding_window": (False,)}, "moe")
    dense = list(config.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise UserError(f"config.json mlp_only_layers = {dense}: the moe family has its dense blocks first"
                        " (mlp_only_layers = [0, 1, ..., n - 1])")
    args = base_args(config, "moe")
    del args["ffn_hidden_override"]  # the dense blocks' size is dense_hidden_dim
    return {**args, **rope_args(config), "qk_norm": "head", "n_dense_layers": len(dense),
            "dense_hidden_dim": require(config, "intermediate_size"),
            "expert_hidden_dim": require(config, "moe_intermediate_size"),
            "n_experts": require(config, "num_experts" if "num_experts" in config else "num_local_experts"),
            "top_k": require(config, "num_experts_per_tok"), "norm_topk": bool(config.get("norm_topk_prob", False)),
            "n_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0, "bias_update_speed": 0.0}


@dataclass
class MoEHF(DecoderHF):
    """The decoder's mapping with the router and one tensor per expert."""

    model_type: str = "qwen3_moe"
    architecture: str = "Qwen3MoeForCausalLM"
    moe_module: str = "mlp"
    """The published name of a block's mixture of experts (``model.layers.N.<moe_module>``)."""
    expert_names: dict = field(default_factory=lambda: dict(_EXPERTS))
    """Our stacked expert weights -> the published name of each expert's tensor."""

    def __post_init__(self):
        self.from_config, self.write_config, self.why_not = from_config, hf_config, unsupported

    def hf_name(self, name: str) -> str:
        m = re.fullmatch(r"layers\.(\d+)\.moe\.router\.gate\.weight", name)
        return f"model.layers.{m.group(1)}.{self.moe_module}.gate.weight" if m else super().hf_name(name)

    def names(self, name: str, args: MoEArgs) -> list[str]:
        """The HF tensors one of ours becomes: one per expert for the stacked expert weights."""
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m and m.group(2) in self.expert_names:
            prefix, kind = f"model.layers.{m.group(1)}.{self.moe_module}.experts", self.expert_names[m.group(2)]
            return [f"{prefix}.{e}.{kind}.weight" for e in range(args.n_experts)]
        return [self.hf_name(name)]
