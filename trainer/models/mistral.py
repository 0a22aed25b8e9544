"""The Mistral family (``mistral``): Llama's decoder whose every layer attends within a sliding window (v0.1) or in
full (v0.3 and later: ``sliding_window`` null)."""

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args
from trainer.models.decoder.spec import decoder_spec
from trainer.models.registry import register_model


def mistral_args(config: dict, base: DecoderArgs) -> dict:
    refuse_unless(config, {"hidden_act": ("silu",)}, "mistral")
    window = config.get("sliding_window")
    return {**base_args(config, "mistral"), **rope_args(config),
            "sliding_window": int(window) if window is not None else 0, "global_every": 0}


MISTRAL_HF = DecoderHF(
    model_type="mistral", architecture="MistralForCausalLM", from_config=mistral_args,
    write_config=lambda a: {"hidden_act": "silu", "sliding_window": a.sliding_window or None},
    why_not=lambda a: "global_every > 0 (Mistral slides every layer)" if a.global_every
    else beyond(a, "MistralForCausalLM", {"sliding_window"}))

FLAVORS = {
    "debugmodel": DecoderArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, ffn_hidden_override=896,
                              rope_theta=1e4, sliding_window=128),
    # config.json of mistralai/Mistral-7B-v0.1 (sliding window 4096) and mistralai/Mistral-7B-v0.3 (none)
    "7B-v0.1": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                           ffn_hidden_override=14336, rope_theta=1e4, sliding_window=4096),
    "7B-v0.3": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32768,
                           ffn_hidden_override=14336, rope_theta=1e6),
}
register_model(decoder_spec("mistral", FLAVORS, MISTRAL_HF))
