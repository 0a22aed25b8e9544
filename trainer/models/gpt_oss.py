"""The gpt-oss family (``gpt_oss``): the mixture-of-experts decoder with attention sinks and biases on every attention
projection, sliding-window layers alternating with full ones (the first slides), yarn rotary scaling, and routed
experts with biases and a clamped SwiGLU in every block. Its router is a biased linear layer whose top-k logits are
softmaxed over the k chosen: the shared router's softmax over all experts renormalised over the chosen k is the same
function (exp(l_i) / sum over the chosen of exp(l_j)).

transformers' layout: one ``gate_up_proj`` per block (experts, hidden, 2 x expert_dim) holding gate and up
interleaved (gate in the even columns), ``down_proj`` (experts, expert_dim, hidden), both transposed relative to
nn.Linear and to our stacked experts, each with a bias. Published checkpoints store them as MXFP4 (dequantized when
read, trainer/hf.py).
"""

import math
import re
from dataclasses import dataclass

import torch

from trainer.errors import UserError
from trainer.models.decoder.hf import base_args, beyond, require_count, require, rope_args, window_args
from trainer.models.moe import moe_spec
from trainer.models.moe.args import MoEArgs
from trainer.models.moe.hf import MoEHF, experts_beyond
from trainer.models.registry import register_model

# Our expert tensors -> the published name in model.layers.N.mlp.experts (w1/w3 share one, interleaved).
_EXPERTS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "w1_bias": "gate_up_proj_bias",
            "w3_bias": "gate_up_proj_bias", "w2_bias": "down_proj_bias"}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _number(config: dict, key: str, default=None, *, positive: bool = True) -> float:
    value = config.get(key, default) if default is not None else require(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise UserError(f"config.json {key} = {value!r}: must be a finite number{' > 0' if positive else ''}")
    return float(value)


# What transformers' GptOssConfig computes where config.json leaves a key out (a hand-written or trimmed file): the
# same model here.
_DEFAULTS = {"rms_norm_eps": 1e-5, "sliding_window": 128,
             "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}}


def gpt_oss_args(config: dict, base: MoEArgs) -> dict:
    if any(k in config for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        config = {k: v for k, v in _DEFAULTS.items() if k != "rope_scaling"} | config
    else:
        config = _DEFAULTS | config
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise UserError(f"config.json layer_types = {types!r}: must be a list of {' or '.join(_LAYER_TYPES)}")
        for entry in types:
            if entry not in _LAYER_TYPES:
                raise UserError(f"config.json layer_types = {types!r}: entry {entry!r} is neither"
                                f" {' nor '.join(_LAYER_TYPES)}")
        if len(types) != require(config, "num_hidden_layers"):
            raise UserError(f"config.json layer_types = {types!r}: {len(types)} entries for num_hidden_layers ="
                            f" {config['num_hidden_layers']}")
    bias = config.get("attention_bias", True)
    if not isinstance(bias, bool):
        raise UserError(f"config.json attention_bias = {bias!r}: must be true or false")
    experts, top_k = require_count(config, "num_local_experts"), require_count(config, "num_experts_per_tok")
    if top_k > experts:
        raise UserError(f"config.json num_experts_per_tok = {top_k}: must be <= num_local_experts = {experts}")
    if types is None:  # transformers' default: every other layer slides, the first one included
        types = [_LAYER_TYPES[i % 2] for i in range(config["num_hidden_layers"])]
    args = base_args(config, "gpt_oss")
    return {**args, **rope_args(config), **window_args({**config, "layer_types": types}, "gpt_oss"),
            "qk_norm": "none", "qkv_bias": bias, "attn_out_bias": bias, "attn_sinks": True, "n_dense_layers": 0,
            "expert_hidden_dim": args.pop("ffn_hidden_override"), "n_experts": experts, "top_k": top_k,
            "norm_topk": True, "n_shared_experts": 0, "score_func": "softmax", "route_scale": 1.0,
            "bias_update_speed": 0.0, "router_bias": True, "expert_biases": True,
            "expert_activation": "swiglu_clamped", "swiglu_limit": _number(config, "swiglu_limit"),
            "swiglu_alpha": _number(config, "swiglu_alpha", 1.702)}


def _write(a: MoEArgs) -> dict:
    return {"intermediate_size": a.expert_hidden_dim, "num_local_experts": a.n_experts,
            "num_experts_per_tok": a.top_k, "router_aux_loss_coef": a.aux_loss_coef, "hidden_act": "silu",
            "attention_bias": a.qkv_bias, "swiglu_limit": a.swiglu_limit, "swiglu_alpha": a.swiglu_alpha,
            "sliding_window": a.sliding_window or None,
            "layer_types": [_LAYER_TYPES[a.window(i) is None] for i in range(a.n_layers)]}


def _why_not(a: MoEArgs) -> str | None:
    if why := experts_beyond(a, "GptOssForCausalLM", holds=("router_bias", "expert_biases", "expert_activation")):
        return why
    gpt_oss = {"attn_sinks": True, "attn_out_bias": a.qkv_bias, "router_bias": True, "expert_biases": True,
               "expert_activation": "swiglu_clamped", "n_dense_layers": 0, "n_shared_experts": 0,
               "bias_update_speed": 0.0, "score_func": "softmax", "norm_topk": True, "route_scale": 1.0}
    off = [f"{k} = {getattr(a, k)!r}" for k, v in gpt_oss.items() if getattr(a, k) != v]
    if off:
        return (f"{', '.join(off)} (GptOssForCausalLM computes sinks, attention biases on all four projections or"
                " none, biased routing by softmax top-k in every block, biased experts with the clamped SwiGLU)")
    return beyond(a, "GptOssForCausalLM", {"qkv_bias", "attn_out_bias", "attn_sinks", "sliding_window",
                                           "global_every"})


@dataclass
class GptOssHF(MoEHF):
    model_type: str = "gpt_oss"
    architecture: str = "GptOssForCausalLM"
    moe_module: str = "mlp"

    def __post_init__(self):
        self.from_config, self.write_config, self.why_not = gpt_oss_args, _write, _why_not

    @staticmethod
    def _expert(name: str) -> str | None:
        m = re.fullmatch(r"layers\.\d+\.moe\.experts\.(\w+)", name)
        return m.group(1) if m and m.group(1) in _EXPERTS else None

    def hf_name(self, name: str) -> str:
        m = re.fullmatch(r"layers\.(\d+)\.moe\.(router\.gate|experts)\.(\w+)", name)
        if m and m.group(2) == "router.gate":
            return f"model.layers.{m.group(1)}.mlp.router.{m.group(3)}"
        if m and m.group(3) in _EXPERTS:
            return f"model.layers.{m.group(1)}.mlp.experts.{_EXPERTS[m.group(3)]}"
        return super().hf_name(name)

    def names(self, name: str, args: MoEArgs) -> list[str]:
        return [self.hf_name(name)]  # the experts are stacked there too

    def to_hf(self, name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
        kind = self._expert(name)
        if kind in ("w1", "w3", "w2"):  # (experts, out, in) -> (experts, in, out)
            return tensor.transpose(1, 2)
        return tensor if kind else super().to_hf(name, tensor, args)

    def join(self, key: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """gate_up_proj (and its bias): gate in the even columns, up in the odd ones."""
        gate = next(t for n, t in parts.items() if self._expert(n) in ("w1", "w1_bias"))
        up = next(t for n, t in parts.items() if self._expert(n) in ("w3", "w3_bias"))
        return torch.stack([gate, up], dim=-1).flatten(-2)

    def from_hf(self, name: str, tensor: torch.Tensor, args: MoEArgs) -> torch.Tensor:
        kind = self._expert(name)
        if kind in ("w1", "w3", "w1_bias", "w3_bias"):
            tensor = tensor[..., 0::2] if kind.startswith("w1") else tensor[..., 1::2]
        if kind in ("w1", "w3", "w2"):
            return tensor.transpose(1, 2)
        return tensor if kind else super().from_hf(name, tensor, args)


def _flavor(**kw) -> MoEArgs:
    return MoEArgs(qk_norm="none", n_dense_layers=0, norm_topk=True, norm_eps=1e-5, qkv_bias=True,
                   attn_out_bias=True, attn_sinks=True, router_bias=True, expert_biases=True,
                   expert_activation="swiglu_clamped", swiglu_limit=7.0, sliding_window=128, global_every=2,
                   rope_theta=150000.0, rope_scaling="yarn", rope_factor=32.0, rope_original_max_seq_len=4096,
                   rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False, **kw)


FLAVORS = {
    "debugmodel": _flavor(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=2048, n_experts=8, top_k=2,
                          expert_hidden_dim=256),
    # config.json of openai/gpt-oss-20b and openai/gpt-oss-120b
    "20b": _flavor(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim_override=64, vocab_size=201088,
                   n_experts=32, top_k=4, expert_hidden_dim=2880, max_seq_len=131072),
    "120b": _flavor(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim_override=64, vocab_size=201088,
                    n_experts=128, top_k=4, expert_hidden_dim=2880, max_seq_len=131072),
}
register_model(moe_spec("gpt_oss", FLAVORS, GptOssHF()))
