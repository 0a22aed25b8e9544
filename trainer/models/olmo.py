"""The OLMo 2 family (``olmo2``): Llama's decoder with the norms after the attention and the feed-forward instead of
before them, and q and k normalised over their whole projections."""

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args
from trainer.models.decoder.spec import decoder_spec
from trainer.models.registry import register_model

NORMS = {"attention_out_norm.weight": "post_attention_layernorm.weight",
         "ffn_out_norm.weight": "post_feedforward_layernorm.weight"}


def olmo2_args(config: dict, base: DecoderArgs) -> dict:
    refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,)}, "olmo2")
    return {**base_args(config, "olmo2"), **rope_args(config), "norm_placement": "post", "qk_norm": "projection"}


def _why_not(a: DecoderArgs) -> str | None:
    if (a.norm_placement, a.qk_norm) != ("post", "projection"):
        return "norm_placement must be 'post' and qk_norm 'projection' (OLMo 2)"
    return beyond(a, "Olmo2ForCausalLM", {"norm_placement", "qk_norm"})


OLMO2_HF = DecoderHF(model_type="olmo2", architecture="Olmo2ForCausalLM", norms=NORMS, from_config=olmo2_args,
                     write_config=lambda a: {"hidden_act": "silu", "attention_bias": False}, why_not=_why_not)

FLAVORS = {
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                              ffn_hidden_override=704, rope_theta=5e5, norm_eps=1e-6, norm_placement="post",
                              qk_norm="projection"),
    # config.json of allenai/OLMo-2-0425-1B and allenai/OLMo-2-1124-7B
    "1B": DecoderArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, vocab_size=100352, ffn_hidden_override=8192,
                      rope_theta=5e5, norm_eps=1e-6, norm_placement="post", qk_norm="projection"),
    "7B": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=100352, ffn_hidden_override=11008,
                      rope_theta=5e5, norm_eps=1e-6, norm_placement="post", qk_norm="projection"),
}
register_model(decoder_spec("olmo2", FLAVORS, OLMO2_HF))
