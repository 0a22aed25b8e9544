"""The Granite family (``granite``): Llama's decoder with its four multipliers, on the embeddings, on each branch
before the residual add, as the softmax scale, and on the logits (as a divisor, ``logits_scaling``)."""

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args
from trainer.models.decoder.spec import decoder_spec
from trainer.models.registry import register_model


def granite_args(config: dict, base: DecoderArgs) -> dict:
    refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)}, "granite")
    return {**base_args(config, "granite"), **rope_args(config),
            "embedding_scale": float(config.get("embedding_multiplier", 1.0)),
            "residual_scale": float(config.get("residual_multiplier", 1.0)),
            "attn_scale": float(config.get("attention_multiplier", 1.0)),
            "logit_scale": 1.0 / float(config.get("logits_scaling", 1.0))}


def _write(a: DecoderArgs) -> dict:
    return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "embedding_multiplier": a.embedding_scale,
            "residual_multiplier": a.residual_scale, "attention_multiplier": a.attn_scale or a.head_dim**-0.5,
            "logits_scaling": 1.0 / a.logit_scale}


GRANITE_HF = DecoderHF(model_type="granite", architecture="GraniteForCausalLM", from_config=granite_args,
                       write_config=_write, why_not=lambda a: beyond(
                           a, "GraniteForCausalLM", {"embedding_scale", "residual_scale", "attn_scale", "logit_scale"}))

FLAVORS = {
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, ffn_hidden_override=704,
                              rope_theta=1e4, embedding_scale=12.0, residual_scale=0.22, attn_scale=0.0078125,
                              logit_scale=1 / 8.0),
}
register_model(decoder_spec("granite", FLAVORS, GRANITE_HF))
