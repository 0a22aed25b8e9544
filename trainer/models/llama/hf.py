"""Hugging Face (transformers LlamaForCausalLM) names, layouts and config for the Llama family.

Our attention rotates consecutive pairs of each head's dimensions (Meta's layout); HF's
rotates the first half against the second. The q and k projections are permuted on the way
out (and back on the way in) so that the exported model computes the same function.
"""

import re

import torch

from trainer.errors import UserError
from trainer.models.registry import HFAdapter
from trainer.models.llama.args import LlamaArgs

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def _heads(name: str, args: LlamaArgs) -> int | None:
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.num_kv_heads
    return None


def to_hf(name: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    heads = _heads(name, args)
    if heads is None:
        return tensor
    out, inp = tensor.shape  # (heads * head_dim, dim): within a head, pairs (2i, 2i+1) -> (i, i + head_dim/2)
    return tensor.view(heads, out // heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def from_hf(name: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    heads = _heads(name, args)
    if heads is None:
        return tensor
    out, inp = tensor.shape
    return tensor.view(heads, 2, out // heads // 2, inp).transpose(1, 2).reshape(out, inp)


def hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _refuse_unless(config: dict, expected: dict, family: str) -> None:
    """config.json settings this family computes only one way: any other value is refused, naming the key."""
    for key, value in expected.items():
        if key in config and config[key] not in value:
            raise UserError(f"config.json {key} = {config[key]!r}: the {family} family computes only {value[0]!r}"
                            " (no other setting is supported)")


def rope_theta(config: dict) -> float:
    """The rotary base, from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5); scaled variants refused."""
    for key in ("rope_scaling", "rope_parameters"):
        scaling = config.get(key) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise UserError(f"config.json {key} = {scaling!r}: not supported (the families here compute plain rotary"
                            " embeddings)")
    return float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0)))


def require(config: dict, key: str):
    if key not in config:
        raise UserError(f"config.json has no {key!r}, which the model needs")
    return config[key]


def ffn_args(hidden: int, dim: int, base: LlamaArgs) -> dict:
    """``multiple_of`` and ``ffn_dim_multiplier`` that give a SwiGLU hidden size of ``hidden`` for ``dim``: the
    base flavor's when they do, else a rounding without multiplier, else a multiplier rounded up to ``hidden``."""
    if LlamaArgs(dim=dim, multiple_of=base.multiple_of,
                 ffn_dim_multiplier=base.ffn_dim_multiplier).ffn_hidden_dim == hidden:
        return {"multiple_of": base.multiple_of, "ffn_dim_multiplier": base.ffn_dim_multiplier}
    if base.ffn_dim_multiplier is None:
        for multiple in (1024, 512, 256, 128, 64, 32, 16, 8):
            if LlamaArgs(dim=dim, multiple_of=multiple).ffn_hidden_dim == hidden:
                return {"multiple_of": multiple, "ffn_dim_multiplier": None}
    # rounding up to a multiple of hidden itself gives exactly hidden for any multiplier in (0, hidden / base]
    return {"multiple_of": hidden, "ffn_dim_multiplier": hidden / int(2 * 4 * dim / 3)}


def from_config(config: dict, base: LlamaArgs) -> dict:
    """config.json -> our args for LlamaForCausalLM: ``[model.overrides]`` keys on top of the flavor ``base``,
    and ``tie_embeddings``. A setting this family cannot compute is one UserError naming the config.json key."""
    _refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                            "pretraining_tp": (1,)}, "llama3")
    dim, heads = require(config, "hidden_size"), require(config, "num_attention_heads")
    if config.get("head_dim") not in (None, dim // heads):
        raise UserError(f"config.json head_dim = {config['head_dim']}: the llama3 family computes head_dim ="
                        f" hidden_size / num_attention_heads = {dim // heads}")
    return {"dim": dim, "n_layers": require(config, "num_hidden_layers"), "n_heads": heads,
            "n_kv_heads": config.get("num_key_value_heads") or heads, "vocab_size": require(config, "vocab_size"),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "rope_theta": rope_theta(config),
            **ffn_args(require(config, "intermediate_size"), dim, base),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False))}


class LlamaHF(HFAdapter):
    model_type = "llama"
    hf_name = staticmethod(hf_name)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    config = staticmethod(hf_config)
    from_config = staticmethod(from_config)
