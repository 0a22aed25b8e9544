"""The Llama 3 family, registered as ``[model] name = "llama3"``: the shared decoder with its defaults
(trainer.models.decoder), Llama 3.1's rotary scaling in the 3.1 and 3.2 flavors."""

from trainer.models.decoder import DecoderArgs, Transformer
from trainer.models.decoder.spec import decoder_spec
from trainer.models.llama.hf import LlamaHF
from trainer.models.registry import register_model

LlamaArgs = DecoderArgs  # the family's args are the decoder's

_LLAMA31 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_seq_len=8192)
_LLAMA32 = {**_LLAMA31, "rope_factor": 32.0}
FLAVORS = {
    # Tiny: trains in seconds on one CPU core. Vocabulary matches the bundled tokenizer cut to 2046 ranks.
    "debugmodel": LlamaArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=64),
    # Smallest real-vocabulary shape; big enough for compute to dominate on CPU benchmarks.
    "270M": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256),
    # Llama 3 shapes with plain rotary embeddings (1B and 3B tie their embeddings, as Llama 3.2's do).
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                    tie_embeddings=True),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
                    tie_embeddings=True),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096),
    # The released Llama 3.1 and 3.2 checkpoints: the same shapes with the llama3 rotary scaling (config.json of
    # meta-llama/Llama-3.1-8B, -70B and meta-llama/Llama-3.2-1B, -3B).
    "3.1-8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_override=14336, **_LLAMA31),
    "3.1-70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_override=28672, **_LLAMA31),
    "3.2-1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_override=8192, tie_embeddings=True,
                        **_LLAMA32),
    "3.2-3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden_override=8192,
                        tie_embeddings=True, **_LLAMA32),
}
register_model(decoder_spec("llama3", FLAVORS, LlamaHF))

__all__ = ["LlamaArgs", "Transformer"]
