"""What every decoder family shares in its Hugging Face mapping: tensor names, the rotary layout of q and k, and the
config.json options common to the transformers classes (rotary bases and scaling, windows, sizes). A family's own
file (trainer/models/families.py) adds its norms' names and the options only it has.

Our attention rotates consecutive pairs of each head's dimensions (Meta's layout); transformers' rotates the first
half against the second. Every tensor laid out by query or key head (the q and k projections' weights and biases,
and their norms' weights) is permuted on the way out and back on the way in, so that the exported model computes
the same function.
"""

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.errors import UserError
from trainer.models.decoder.args import DecoderArgs
from trainer.models.registry import HFAdapter

logger = logging.getLogger(__name__)

TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight", "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight", "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks.weight": "self_attn.sinks",
    "attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# The block norms as the Llama-style classes name them (one before each branch).
PRE_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}


def _heads_of(name: str, args: DecoderArgs) -> tuple[int, int] | None:
    """(heads, head_dim) of a tensor laid out by query or key head along dim 0, else None."""
    if re.search(r"attention\.(wq|q_norm)\.", name):
        heads = args.n_heads
    elif re.search(r"attention\.(wk|k_norm)\.", name):
        heads = args.num_kv_heads
    else:
        return None
    if "_norm" in name and args.qk_norm == "head":
        return 1, args.head_dim
    return heads, args.head_dim


def pairs_to_halves(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Within each head, dimension pairs (2i, 2i+1) -> (i, i + head_dim / 2), along dim 0."""
    rest = tensor.shape[1:]
    return tensor.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def halves_to_pairs(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    rest = tensor.shape[1:]
    return tensor.reshape(heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(tensor.shape)


@dataclass
class DecoderHF(HFAdapter):
    """One family's mapping: its ``model_type`` and class, the names of its block norms, and the two config
    functions (``from_config``: config.json -> our args; ``write_config``: args -> config.json)."""

    model_type: str = ""
    architecture: str = ""
    norms: dict[str, str] = field(default_factory=lambda: dict(PRE_NORMS))
    from_config: Callable[[dict, DecoderArgs], dict] | None = None
    write_config: Callable[[DecoderArgs], dict] | None = None
    why_not: Callable[[DecoderArgs], str | None] = lambda args: None
    """Why the transformers class cannot hold a model of these args (export refused when planned), or None."""

    def hf_name(self, name: str) -> str:
        if name in TOP:
            return TOP[name]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        inner = m and (BLOCK.get(m.group(2)) or self.norms.get(m.group(2)))
        if not inner:
            raise UserError(f"the {self.model_type} checkpoint layout has no place for {name}")
        return f"model.layers.{m.group(1)}.{inner}"

    def to_hf(self, name: str, tensor: torch.Tensor, args: DecoderArgs) -> torch.Tensor:
        heads = _heads_of(name, args)
        return tensor if heads is None else pairs_to_halves(tensor, *heads)

    def from_hf(self, name: str, tensor: torch.Tensor, args: DecoderArgs) -> torch.Tensor:
        heads = _heads_of(name, args)
        return tensor if heads is None else halves_to_pairs(tensor, *heads)

    def config(self, args: DecoderArgs, dtype: torch.dtype) -> dict:
        return {"architectures": [self.architecture], "model_type": self.model_type, **common_config(args),
                **self.write_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}

    def unsupported(self, args: DecoderArgs) -> str | None:
        return self.why_not(args)


def common_config(args: DecoderArgs) -> dict:
    """The config.json entries every decoder class reads alike."""
    return {"hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.tie_embeddings, **rope_config(args)}


def rope_config(args: DecoderArgs) -> dict:
    """``rope_theta`` and ``rope_scaling`` as transformers 4 writes them (transformers 5 reads them too)."""
    scaling = None
    if args.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": args.rope_factor, "low_freq_factor": args.rope_low_freq_factor,
                   "high_freq_factor": args.rope_high_freq_factor,
                   "original_max_position_embeddings": args.rope_original_max_seq_len}
    elif args.rope_scaling in ("linear", "dynamic"):
        scaling = {"rope_type": args.rope_scaling, "factor": args.rope_factor}
    elif args.rope_scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": args.rope_factor, "beta_fast": args.rope_beta_fast,
                   "beta_slow": args.rope_beta_slow, "truncate": args.rope_truncate,
                   "original_max_position_embeddings": args.rope_original_max_seq_len}
        if args.rope_attention_factor is not None:
            scaling["attention_factor"] = args.rope_attention_factor
    return {"rope_theta": args.rope_theta, "rope_scaling": scaling}


def refuse_unless(config: dict, expected: dict, family: str) -> None:
    """config.json settings this family computes only one way: any other value is refused, naming the key."""
    for key, value in expected.items():
        if key in config and config[key] not in value:
            raise UserError(f"config.json {key} = {config[key]!r}: the {family} family computes only {value[0]!r}"
                            " (no other setting is supported)")


def require(config: dict, key: str):
    if key not in config:
        raise UserError(f"config.json has no {key!r}, which the model needs")
    return config[key]


def require_count(config: dict, key: str, *, at_least: int = 1) -> int:
    """``config[key]``, a whole number >= ``at_least`` (a missing key or another value is one line)."""
    value = require(config, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < at_least:
        raise UserError(f"config.json {key} = {value!r}: must be a whole number >= {at_least}")
    return value


def _rope_entries(config: dict) -> tuple[dict, dict | None]:
    """(the full-attention layers' rotary parameters, the sliding layers' own or None) from transformers 5's
    ``rope_parameters`` (flat, or one entry per layer type) or transformers 4's ``rope_theta`` / ``rope_scaling``
    (and Gemma 3's ``rope_local_base_freq``)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return params["full_attention"] or {}, params.get("sliding_attention")
    if isinstance(params, dict):
        return params, None
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    local = config.get("rope_local_base_freq")
    return scaling, ({"rope_type": "default", "rope_theta": local} if local is not None else None)


def rope_args(config: dict, *, local_default: float | None = None) -> dict:
    """Our rotary options from config.json; a scaling type not computed here is one line naming it."""
    full, local = _rope_entries(config)
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    kind = full.get("rope_type", full.get("type", "default"))
    out = {"rope_theta": float(full.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        out.update(rope_scaling="llama3", rope_factor=float(full["factor"]),
                   rope_low_freq_factor=float(full.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(full.get("high_freq_factor", 4.0)),
                   rope_original_max_seq_len=int(full.get("original_max_position_embeddings", 8192)))
    elif kind in ("linear", "dynamic"):
        out.update(rope_scaling=kind, rope_factor=float(full["factor"]),
                   rope_original_max_seq_len=int(full.get("original_max_position_embeddings",
                                                          config.get("max_position_embeddings", 8192))))
    elif kind == "yarn":
        original = int(full.get("original_max_position_embeddings", config.get("max_position_embeddings", 4096)))
        factor = full.get("factor")
        factor = float(factor) if factor is not None else config.get("max_position_embeddings", original) / original
        mscale, mscale_all = full.get("mscale"), full.get("mscale_all_dim")
        attention = full.get("attention_factor")
        if attention is None and mscale and mscale_all and factor > 1:  # DeepSeek's ratio of two mscales
            attention = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all * math.log(factor) + 1)
        out.update(rope_scaling="yarn", rope_factor=factor, rope_original_max_seq_len=original,
                   rope_beta_fast=float(full.get("beta_fast") or 32.0),
                   rope_beta_slow=float(full.get("beta_slow") or 1.0),
                   rope_attention_factor=float(attention) if attention is not None else None,
                   rope_truncate=bool(full.get("truncate", True)))
    elif kind != "default":
        raise UserError(f"config.json {key} = {full!r}: rope_type {kind!r} is not supported (computed here:"
                        " default, llama3, linear, dynamic, yarn)")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise UserError(f"config.json {key} = {config.get(key)!r}: the sliding layers' rope_type"
                            f" {local.get('rope_type')!r} is not supported (only default)")
        out["rope_local_theta"] = float(local.get("rope_theta", local_default or 10000.0))
    elif local_default is not None:
        out["rope_local_theta"] = local_default
    return out


def window_args(config: dict, family: str) -> dict:
    """``sliding_window`` and ``global_every`` from config.json's ``sliding_window`` and ``layer_types`` (or
    transformers 4's ``sliding_window_pattern``): every layer sliding, or every N-th one in full. Another pattern
    is one line naming ``layer_types``."""
    window = config.get("sliding_window")
    layers = require(config, "num_hidden_layers")
    types = config.get("layer_types")
    if window is None or (types is not None and "sliding_attention" not in types):
        return {"sliding_window": 0, "global_every": 0}
    if types is None:
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern"))
        return {"sliding_window": int(window), "global_every": int(pattern or 0)}
    for every in [0] + list(range(1, layers + 1)):
        made = DecoderArgs(n_layers=layers, sliding_window=int(window), global_every=every)
        if [("sliding_attention" if made.window(i) else "full_attention") for i in range(layers)] == list(types):
            return {"sliding_window": int(window), "global_every": every}
    raise UserError(f"config.json layer_types = {types!r}: the {family} family computes sliding layers with every"
                    " N-th layer (or none) attending in full, not this pattern")


def base_args(config: dict, family: str, *, tied: bool = False) -> dict:
    """The sizes every decoder class describes alike, as our args; ``tied``: the class's default for
    ``tie_word_embeddings``."""
    dim, heads = require(config, "hidden_size"), require(config, "num_attention_heads")
    if config.get("output_router_logits") is True and config.get("router_aux_loss_coef"):
        # transformers adds its load-balancing loss only with output_router_logits; ours is another formula
        logger.warning("config.json output_router_logits = true, router_aux_loss_coef = %r: transformers' balance loss"
                       " is not imported (trained without one; [model.overrides] aux_loss_coef turns on this"
                       " trainer's sequence-wise balance loss)", config["router_aux_loss_coef"])
    head_dim = config.get("head_dim") or dim // heads
    context = config.get("max_position_embeddings")
    context = {"max_seq_len": context} if isinstance(context, int) and not isinstance(context, bool) else {}
    return {**context, "dim": dim, "n_layers": require(config, "num_hidden_layers"), "n_heads": heads,
            "n_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim_override": head_dim,  # explicit even where it is dim // heads (never None in a config file)
            "vocab_size": require(config, "vocab_size"), "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "ffn_hidden_override": require(config, "intermediate_size"),
            "tie_embeddings": tied_embeddings(config, tied)}


def tied_embeddings(config: dict, default: bool) -> bool:
    """``tie_word_embeddings``, which must be a JSON boolean (a string such as "no" is not read as true)."""
    value = config.get("tie_word_embeddings", default)
    if not isinstance(value, bool):
        raise UserError(f"config.json tie_word_embeddings = {value!r}: must be true or false")
    return value


# The decoder's options and their Llama defaults: a transformers class that lacks one cannot hold a model that sets it.
OPTIONS = {"qkv_bias": False, "attn_out_bias": False, "attn_sinks": False,
           "qk_norm": "none", "attn_scale": None, "attn_softcap": 0.0, "sliding_window": 0,
           "global_every": 0, "rope_local_theta": None, "norm_placement": "pre", "norm_offset": 0.0,
           "activation": "silu", "embedding_scale": 1.0, "residual_scale": 1.0, "logit_scale": 1.0,
           "final_softcap": 0.0, "kv_lora_rank": 0}


def beyond(args: DecoderArgs, architecture: str, holds: set[str] = frozenset()) -> str | None:
    """The options ``args`` set that ``architecture`` cannot hold (those in ``holds`` it can), as one reason."""
    extra = [f"{k} = {getattr(args, k)!r}" for k, default in OPTIONS.items()
             if k not in holds and getattr(args, k) != default]
    return f"{', '.join(extra)} ({architecture} has no such option)" if extra else None
