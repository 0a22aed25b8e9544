"""The DeepSeek-V3 family (``deepseek_v3``): the mixture-of-experts decoder with multi-head latent attention
(trainer/models/mla.py), sigmoid scores with a per-expert choosing bias (``e_score_correction_bias``, moved by
``bias_update_speed`` in training), grouped top-k routing, shared experts and dense first blocks; transformers'
DeepseekV3ForCausalLM layout (one tensor per expert, as the published checkpoints hold them).

The published weights rotate consecutive pairs of the rotary dimensions (``rope_interleave = true``), as our
attention does: q and k need no permutation. The multi-token-prediction layer of the published checkpoint is not
read (no such module here). yarn's ``mscale_all_dim`` scales the softmax by its mscale squared: it becomes
``attn_scale`` on import and is written back from it on export.
"""

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field

import torch

from trainer.errors import UserError
from trainer.models.decoder.hf import base_args, beyond, require_count, refuse_unless, rope_args, rope_config
from trainer.models.moe import build_tp_plan as moe_tp_plan
from trainer.models.moe import moe_spec
from trainer.models.moe.args import MoEArgs
from trainer.models.moe.hf import MoEHF, experts_beyond
from trainer.models.registry import register_model

logger = logging.getLogger(__name__)

FAMILY = "deepseek_v3"
_NAMES = {  # ours (within a block) -> transformers'
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}


def _mscale(factor: float, mscale: float) -> float:
    """yarn's magnitude correction for a context stretched ``factor`` times."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def deepseek_args(config: dict, base: MoEArgs) -> dict:
    """config.json of DeepseekV3ForCausalLM -> our args; what transformers' class would compute otherwise than
    we do is one line naming the key."""
    refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,), "scoring_func": ("sigmoid",),
                           "topk_method": ("noaux_tc",), "rope_interleave": (True,), "moe_layer_freq": (1,)}, FAMILY)
    args = base_args(config, FAMILY)
    if mtp := config.get("num_nextn_predict_layers"):
        logger.warning("config.json num_nextn_predict_layers = %r: the multi-token-prediction layer is not read (its"
                       " tensors stay in the folder; the model predicts the next token only)", mtp)
    del args["ffn_hidden_override"]  # the dense blocks' size is dense_hidden_dim
    heads, layers = args["n_heads"], args["n_layers"]
    kv_lora, rope = require_count(config, "kv_lora_rank"), require_count(config, "qk_rope_head_dim")
    nope = require_count(config, "qk_nope_head_dim", at_least=0)
    q_lora = config.get("q_lora_rank")
    q_lora = 0 if q_lora is None else require_count(config, "q_lora_rank", at_least=0)
    experts, groups = require_count(config, "n_routed_experts"), require_count(config, "n_group")
    top_groups, top_k = require_count(config, "topk_group"), require_count(config, "num_experts_per_tok")
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise UserError(f"config.json n_group = {groups}: must divide n_routed_experts = {experts} into groups of at"
                        " least 2 experts")
    if top_groups > groups:
        raise UserError(f"config.json topk_group = {top_groups}: must be <= n_group = {groups}")
    if top_k > top_groups * (experts // groups):
        raise UserError(f"config.json num_experts_per_tok = {top_k}: more than the {top_groups * (experts // groups)}"
                        f" experts of topk_group = {top_groups} groups")
    dense = require_count(config, "first_k_dense_replace", at_least=0)
    if dense >= layers:
        raise UserError(f"config.json first_k_dense_replace = {dense}: must be < num_hidden_layers = {layers} (at"
                        " least one block of experts)")
    rope_options = rope_args(config)
    # transformers multiplies the softmax scale by yarn's mscale (of mscale_all_dim) squared
    scale = (nope + rope) ** -0.5
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope_options.get("rope_scaling", "none") != "none" and params.get("mscale_all_dim"):
        scale *= _mscale(rope_options["rope_factor"], float(params["mscale_all_dim"])) ** 2
    return {**args, **rope_options, "n_kv_heads": heads, "head_dim_override": nope + rope, "qk_norm": "none",
            "kv_lora_rank": kv_lora, "q_lora_rank": q_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": require_count(config, "v_head_dim"), "attn_scale": scale, "n_dense_layers": dense,
            "dense_hidden_dim": require_count(config, "intermediate_size"),
            "expert_hidden_dim": require_count(config, "moe_intermediate_size"), "n_experts": experts, "top_k": top_k,
            "n_expert_groups": groups, "topk_groups": top_groups,
            "n_shared_experts": require_count(config, "n_shared_experts", at_least=0),
            "norm_topk": bool(config.get("norm_topk_prob", True)),
            # where config.json leaves a key out, transformers' class defaults (a scale of 2.5)
            "route_scale": float(config.get("routed_scaling_factor", 2.5)), "score_func": "sigmoid",
            "expert_bias": True}


def _mscale_all_dim(a: MoEArgs) -> float | None:
    """The mscale_all_dim that gives ``attn_scale`` in transformers (0: none), or None where none can."""
    plain = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
    ratio = (a.attn_scale or plain) / plain
    if math.isclose(ratio, 1.0, rel_tol=1e-12):
        return 0.0
    if a.rope_scaling not in ("yarn", "linear", "dynamic", "llama3") or a.rope_factor <= 1 or ratio < 1:
        return None
    return (math.sqrt(ratio) - 1) / (0.1 * math.log(a.rope_factor))


def _write(a: MoEArgs) -> dict:
    rope = rope_config(a)
    if rope["rope_scaling"] is not None and _mscale_all_dim(a):
        rope["rope_scaling"]["mscale_all_dim"] = _mscale_all_dim(a)
    return {**rope, "intermediate_size": a.dense_hidden_dim, "moe_intermediate_size": a.expert_hidden_dim,
            "n_routed_experts": a.n_experts, "num_experts_per_tok": a.top_k, "n_shared_experts": a.n_shared_experts,
            "routed_scaling_factor": a.route_scale, "norm_topk_prob": a.norm_topk, "n_group": a.n_expert_groups,
            "topk_group": a.topk_groups, "first_k_dense_replace": a.n_dense_layers, "kv_lora_rank": a.kv_lora_rank,
            "q_lora_rank": a.q_lora_rank or None, "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "head_dim": a.qk_rope_head_dim,
            "num_key_value_heads": a.n_heads, "rope_interleave": True, "attention_bias": False, "hidden_act": "silu",
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}


def _why_not(a: MoEArgs) -> str | None:
    if why := experts_beyond(a, "DeepseekV3ForCausalLM", holds=("n_expert_groups", "expert_bias")):
        return why
    if not a.kv_lora_rank:
        return "kv_lora_rank = 0 (DeepseekV3ForCausalLM's attention is latent attention)"
    if a.score_func != "sigmoid" or not (a.expert_bias or a.bias_update_speed):
        return "routing other than sigmoid scores with a choosing bias (DeepseekV3ForCausalLM routing)"
    if a.rope_scaling == "dynamic" or _mscale_all_dim(a) is None:
        return (f"attn_scale = {a.attn_scale!r} with rope_scaling = {a.rope_scaling!r} (DeepseekV3ForCausalLM scales"
                " the softmax by (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 times a yarn mscale squared)")
    return beyond(a, "DeepseekV3ForCausalLM", {"attn_scale", "kv_lora_rank"})


@dataclass
class DeepSeekHF(MoEHF):
    model_type: str = FAMILY
    architecture: str = "DeepseekV3ForCausalLM"
    moe_module: str = "mlp"
    expert_names: dict = field(default_factory=lambda: {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj",
                                                        "moe.experts.w2": "down_proj"})

    def __post_init__(self):
        self.from_config, self.write_config, self.why_not = deepseek_args, _write, _why_not

    def hf_name(self, name: str) -> str:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m and m.group(2) in _NAMES:
            return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}"
        return super().hf_name(name)

    # Latent attention rotates consecutive pairs, as the published (interleaved) weights are laid out.
    def to_hf(self, name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
        return tensor

    def from_hf(self, name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
        return tensor


def build_tp_plan(*, sequence_parallel: bool, loss_parallel: bool):
    """The MoE family's plan with latent attention's heads split (trainer/models/mla_tp.py)."""
    from trainer.models.mla_tp import add_latent_attention

    top, block = moe_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    add_latent_attention(block, sequence_parallel=sequence_parallel)
    return top, block


def _flavor(**kw) -> MoEArgs:
    return MoEArgs(qk_norm="none", score_func="sigmoid", expert_bias=True, bias_update_speed=1e-3, norm_topk=True,
                   n_shared_experts=1, route_scale=2.5, norm_eps=1e-6, rope_theta=10000.0, **kw)


FLAVORS = {
    "debugmodel": _flavor(dim=256, n_layers=4, n_heads=8, vocab_size=2048, kv_lora_rank=64, q_lora_rank=96,
                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim_override=48,
                          n_dense_layers=1, dense_hidden_dim=512, n_experts=8, top_k=2, n_expert_groups=4,
                          topk_groups=2, expert_hidden_dim=128),
    # config.json of deepseek-ai/DeepSeek-V3 (yarn: factor 40 over 4096 positions, mscale = mscale_all_dim = 1)
    "671B": _flavor(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, kv_lora_rank=512, q_lora_rank=1536,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim_override=192,
                    n_dense_layers=3, dense_hidden_dim=18432, n_experts=256, top_k=8, n_expert_groups=8,
                    topk_groups=4, expert_hidden_dim=2048, rope_scaling="yarn", rope_factor=40.0,
                    rope_original_max_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
                    rope_attention_factor=1.0, attn_scale=192**-0.5 * _mscale(40.0, 1.0) ** 2),
}
register_model(dataclasses.replace(moe_spec(FAMILY, FLAVORS, DeepSeekHF()), build_tp_plan=build_tp_plan,
                                   tp_divisible=lambda args: {"n_heads": args.n_heads}))
