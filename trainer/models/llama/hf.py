"""Hugging Face (transformers LlamaForCausalLM) names, layouts and config for the Llama family.

Our attention rotates consecutive pairs of each head's dimensions (Meta's layout); HF's
rotates the first half against the second. The q and k projections are permuted on the way
out (and back on the way in) so that the exported model computes the same function.
"""

import re

import torch

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


O = "[model.overrides] "
# config.json key -> our key that sets it (named when an imported config.json differs from the model)
CONFIG_KEYS = {
    "hidden_size": O + "dim", "num_hidden_layers": O + "n_layers", "num_attention_heads": O + "n_heads",
    "num_key_value_heads": O + "n_kv_heads", "vocab_size": O + "vocab_size", "rms_norm_eps": O + "norm_eps",
    "rope_theta": O + "rope_theta", "tie_word_embeddings": "[model] tie_embeddings",
    "intermediate_size": O + "ffn_dim_multiplier and multiple_of", "head_dim": O + "dim / n_heads",
}


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
