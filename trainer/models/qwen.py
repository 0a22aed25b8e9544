"""The Qwen 2 / 2.5 (``qwen2``) and Qwen 3 (``qwen3``) dense families: Llama's decoder with biases on q, k and v
(Qwen 2) or an RMSNorm of q and k per head and a head size of its own (Qwen 3)."""

from trainer.errors import UserError
from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args
from trainer.models.decoder.spec import decoder_spec
from trainer.models.registry import register_model


def _common(config: dict, family: str) -> dict:
    refuse_unless(config, {"hidden_act": ("silu",)}, family)
    if config.get("use_sliding_window"):
        raise UserError(f"config.json use_sliding_window = {config['use_sliding_window']!r}: the {family} family"
                        " attends in full (the published models do; sliding layers past max_window_layers are not"
                        " computed here)")
    return {**base_args(config, family), **rope_args(config)}


def qwen2_args(config: dict, base: DecoderArgs) -> dict:
    return {**_common(config, "qwen2"), "qkv_bias": True}


def qwen3_args(config: dict, base: DecoderArgs) -> dict:
    refuse_unless(config, {"attention_bias": (False,)}, "qwen3")
    return {**_common(config, "qwen3"), "qk_norm": "head"}


_WRITE = {"hidden_act": "silu", "use_sliding_window": False, "sliding_window": None}
QWEN2_HF = DecoderHF(model_type="qwen2", architecture="Qwen2ForCausalLM", from_config=qwen2_args,
                     write_config=lambda args: dict(_WRITE),
                     why_not=lambda a: "qkv_bias = False (Qwen 2 has q/k/v biases)" if not a.qkv_bias
                     else beyond(a, "Qwen2ForCausalLM", {"qkv_bias"}))
QWEN3_HF = DecoderHF(model_type="qwen3", architecture="Qwen3ForCausalLM", from_config=qwen3_args,
                     write_config=lambda args: {**_WRITE, "attention_bias": False},
                     why_not=lambda a: "qk_norm must be 'head' (Qwen 3)" if a.qk_norm != "head"
                     else beyond(a, "Qwen3ForCausalLM", {"qk_norm"}))

QWEN2_FLAVORS = {
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, ffn_hidden_override=704,
                              rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
    # config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B
    "2.5-0.5B": DecoderArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936,
                            ffn_hidden_override=4864, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
                            tie_embeddings=True),
    "2.5-7B": DecoderArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
                          ffn_hidden_override=18944, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True),
}
QWEN3_FLAVORS = {
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, ffn_hidden_override=768,
                              rope_theta=1e6, norm_eps=1e-6, qk_norm="head"),
    # config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B
    "0.6B": DecoderArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim_override=128, vocab_size=151936,
                        ffn_hidden_override=3072, rope_theta=1e6, norm_eps=1e-6, qk_norm="head", tie_embeddings=True),
    "8B": DecoderArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim_override=128, vocab_size=151936,
                      ffn_hidden_override=12288, rope_theta=1e6, norm_eps=1e-6, qk_norm="head"),
}
register_model(decoder_spec("qwen2", QWEN2_FLAVORS, QWEN2_HF))
register_model(decoder_spec("qwen3", QWEN3_FLAVORS, QWEN3_HF))
