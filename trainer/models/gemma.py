"""The Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``) families: the shared decoder with a norm before and
after each branch whose weights sit around 0 (scale 1 + weight), a GeGLU feed-forward, embeddings scaled by
sqrt(dim), a softmax scale from ``query_pre_attn_scalar``, sliding-window layers with every N-th one in full, and
tied embeddings. Gemma 2 soft-caps the attention logits and the output; Gemma 3 normalises q and k per head and gives
its sliding layers a rotary base of their own."""

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args, window_args
from trainer.models.decoder.spec import decoder_spec
from trainer.models.registry import register_model

NORMS = {"attention_norm.weight": "input_layernorm.weight",
         "attention_out_norm.weight": "post_attention_layernorm.weight",
         "ffn_norm.weight": "pre_feedforward_layernorm.weight",
         "ffn_out_norm.weight": "post_feedforward_layernorm.weight"}


def _gemma(config: dict, family: str) -> dict:
    refuse_unless(config, {"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,),
                           "use_bidirectional_attention": (False, None)}, family)
    args = {**base_args(config, family, tied=True), **window_args(config, family)}
    dim = args["dim"]
    head_dim = args["head_dim_override"] or dim // args["n_heads"]
    return {**args, "norm_placement": "sandwich", "norm_offset": 1.0, "activation": "gelu_tanh",
            "embedding_scale": dim**0.5, "attn_scale": float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            "attn_softcap": float(config.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(config.get("final_logit_softcapping") or 0.0)}


def gemma2_args(config: dict, base: DecoderArgs) -> dict:
    return {**_gemma(config, "gemma2"), **rope_args(config)}


def gemma3_args(config: dict, base: DecoderArgs) -> dict:
    return {**_gemma(config, "gemma3_text"), **rope_args(config, local_default=10000.0), "qk_norm": "head"}


def _write(a: DecoderArgs) -> dict:
    types = ["full_attention" if a.window(i) is None else "sliding_attention" for i in range(a.n_layers)]
    scalar = (a.attn_scale or a.head_dim**-0.5) ** -2
    if abs(scalar - round(scalar)) < 1e-6 * scalar:  # transformers declares it an int
        scalar = round(scalar)
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "sliding_window": a.sliding_window or None, "layer_types": types,
            "attn_logit_softcapping": a.attn_softcap or None,
            "final_logit_softcapping": a.final_softcap or None, "attention_bias": False,
            **({"rope_local_base_freq": a.rope_local_theta} if a.rope_local_theta is not None else {})}


def _why_not(a: DecoderArgs, architecture: str, holds: set[str]) -> str | None:
    gemma = {"norm_placement": "sandwich", "norm_offset": 1.0, "activation": "gelu_tanh", "embedding_scale": a.dim**0.5}
    off = [f"{k} = {getattr(a, k)!r}" for k, v in gemma.items() if getattr(a, k) != v]
    if off:
        return f"{', '.join(off)} ({architecture} computes {', '.join(f'{k} = {v!r}' for k, v in gemma.items())})"
    return beyond(a, architecture, set(gemma) | holds)


GEMMA2_HF = DecoderHF(model_type="gemma2", architecture="Gemma2ForCausalLM", norms=NORMS, from_config=gemma2_args,
                      write_config=_write, why_not=lambda a: _why_not(
                          a, "Gemma2ForCausalLM", {"attn_scale", "attn_softcap", "final_softcap", "sliding_window",
                                                   "global_every"}))
GEMMA3_HF = DecoderHF(model_type="gemma3_text", architecture="Gemma3ForCausalLM", norms=NORMS,
                      from_config=gemma3_args, write_config=_write, why_not=lambda a: _why_not(
                          a, "Gemma3ForCausalLM", {"attn_scale", "sliding_window", "global_every", "rope_local_theta",
                                                   "qk_norm", "attn_softcap", "final_softcap"}))


def _flavor(**kw) -> DecoderArgs:
    dim = kw["dim"]
    return DecoderArgs(norm_placement="sandwich", norm_offset=1.0, activation="gelu_tanh", embedding_scale=dim**0.5,
                       tie_embeddings=True, norm_eps=1e-6, **kw)


GEMMA2_FLAVORS = {
    "debugmodel": _flavor(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim_override=32, vocab_size=2048,
                          ffn_hidden_override=1024, rope_theta=1e4, attn_scale=32**-0.5, sliding_window=128,
                          global_every=2, attn_softcap=50.0, final_softcap=30.0),
    # config.json of google/gemma-2-2b
    "2B": _flavor(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim_override=256, vocab_size=256000,
                  ffn_hidden_override=9216, rope_theta=1e4, attn_scale=256**-0.5, sliding_window=4096, global_every=2,
                  attn_softcap=50.0, final_softcap=30.0),
}
GEMMA3_FLAVORS = {
    "debugmodel": _flavor(dim=256, n_layers=6, n_heads=4, n_kv_heads=1, head_dim_override=64, vocab_size=2048,
                          ffn_hidden_override=1024, rope_theta=1e6, rope_local_theta=1e4, attn_scale=64**-0.5,
                          sliding_window=128, global_every=6, qk_norm="head"),
    # config.json of google/gemma-3-1b-pt and the text model of google/gemma-3-4b-pt
    "1B": _flavor(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim_override=256, vocab_size=262144,
                  ffn_hidden_override=6912, rope_theta=1e6, rope_local_theta=1e4, attn_scale=256**-0.5,
                  sliding_window=512, global_every=6, qk_norm="head"),
    "4B": _flavor(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim_override=256, vocab_size=262208,
                  ffn_hidden_override=10240, rope_theta=1e6, rope_local_theta=1e4, rope_scaling="linear",
                  rope_factor=8.0, attn_scale=256**-0.5, sliding_window=1024, global_every=6, qk_norm="head"),
}
register_model(decoder_spec("gemma2", GEMMA2_FLAVORS, GEMMA2_HF))
register_model(decoder_spec("gemma3_text", GEMMA3_FLAVORS, GEMMA3_HF))
