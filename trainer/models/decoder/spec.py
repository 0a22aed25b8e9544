"""``decoder_spec``: a family built on the shared decoder is a ModelSpec with the decoder's model, costs, plans and
checks, and the family's own flavors and Hugging Face mapping."""

from trainer.models.decoder.args import DecoderArgs, validate_decoder_args
from trainer.models.decoder.model import (TIED_WEIGHTS, Transformer, decoder_activation_bytes,
                                          decoder_flops_per_token)
from trainer.errors import ConfigError
from trainer.models.registry import HFAdapter, ModelSpec


def build_tp_plan(**kwargs):
    """trainer/models/decoder/tp_plan.py, imported when tensor parallelism is used (it imports DTensor, ~0.5 s)."""
    from trainer.models.decoder.tp_plan import build_tp_plan as build

    return build(**kwargs)


def validate_dense_args(args: DecoderArgs) -> None:
    if args.kv_lora_rank:
        raise ConfigError(f"[model.overrides] kv_lora_rank={args.kv_lora_rank}: latent attention is built by the"
                          " mixture-of-experts families (deepseek_v3, moe), not by this dense one")
    validate_decoder_args(args)


def decoder_job_limits(args: DecoderArgs, dims) -> str | None:
    """What of the decoder's options this job's sequence length or parallel layout cannot run, as one line naming
    the keys."""
    if args.rope_scaling == "dynamic" and args.max_seq_len > args.rope_original_max_seq_len:
        return (f"[model.overrides] rope_scaling = 'dynamic': NTK scaling rescales by the length of each sequence"
                f" past rope_original_max_seq_len = {args.rope_original_max_seq_len}, which this job's sequences"
                f" ({args.max_seq_len} tokens) exceed: not supported (up to that length it is plain rotary)")
    if dims.tp > 1 and args.qk_norm == "projection":
        return (f"[parallelism] tensor_parallel_degree={dims.tp}: not supported for this model, whose q/k norm spans"
                " the whole projection ([model.overrides] qk_norm = 'projection', OLMo 2), across the heads tensor"
                " parallelism splits")
    if dims.cp > 1 and args.attn_softcap:
        return (f"[parallelism] context_parallel_degree={dims.cp}: not supported for this model, whose attention"
                f" logits are soft-capped ([model.overrides] attn_softcap = {args.attn_softcap:g}, Gemma 2), which"
                " context parallelism's attention does not compute")
    if dims.cp > 1 and args.attn_sinks:
        return (f"[parallelism] context_parallel_degree={dims.cp}: not supported for this model, whose attention has"
                " sinks ([model.overrides] attn_sinks = true, gpt-oss), which context parallelism's attention does not"
                " compute")
    return None


def decoder_spec(name: str, flavors: dict[str, DecoderArgs], hf: HFAdapter, **extra) -> ModelSpec:
    """The ModelSpec of a decoder family: ``flavors`` are its presets, ``hf`` its checkpoint mapping."""
    fields = dict(
        name=name, model_cls=Transformer, flavors=flavors, flops_per_token=decoder_flops_per_token,
        build_tp_plan=build_tp_plan, tied_weights=TIED_WEIGHTS,
        tp_divisible=lambda args: {"n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads}, positions=True,
        activation_bytes=decoder_activation_bytes, validate_args=validate_dense_args,
        job_limits=decoder_job_limits, hf=hf)
    return ModelSpec(**{**fields, **extra})
