"""Hugging Face mapping of the Llama family: transformers' LlamaForCausalLM, with Llama 3.1's rotary scaling
(``rope_scaling`` of type llama3) and the linear and dynamic kinds, tied or untied embeddings."""

from trainer.models.decoder.args import DecoderArgs
from trainer.models.decoder.hf import DecoderHF, base_args, beyond, refuse_unless, rope_args


def from_config(config: dict, base: DecoderArgs) -> dict:
    """config.json -> our args for LlamaForCausalLM: ``[model.overrides]`` keys on top of the flavor ``base``,
    and ``tie_embeddings``. A setting this family cannot compute is one UserError naming the config.json key."""
    refuse_unless(config, {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                           "pretraining_tp": (1,)}, "llama3")
    return {**base_args(config, "llama3"), **rope_args(config)}


LlamaHF = DecoderHF(model_type="llama", architecture="LlamaForCausalLM", from_config=from_config,
                    write_config=lambda a: {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
                    why_not=lambda a: beyond(a, "LlamaForCausalLM"))
