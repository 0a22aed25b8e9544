"""The shared decoder every built-in family is built on: its options (``args``), the model (``model``), its
tensor-parallel plan (``tp_plan``) and the mapping to Hugging Face checkpoints that families share (``hf``)."""

from trainer.models.decoder.args import DecoderArgs, validate_decoder_args
from trainer.models.decoder.model import (TIED_WEIGHTS, Transformer, decoder_activation_bytes,
                                          decoder_flops_per_token)

__all__ = ["TIED_WEIGHTS", "DecoderArgs", "Transformer", "decoder_activation_bytes", "decoder_flops_per_token",
           "validate_decoder_args"]
