"""The built-in Llama 3 family, registered as ``[model] name = "llama3"``."""

from trainer.models.llama import hf
from trainer.models.llama.args import FLAVORS, LlamaArgs, validate_llama_args
from trainer.models.llama.model import TIED_WEIGHTS, Transformer, llama_activation_bytes, llama_flops_per_token
from trainer.models.registry import ModelSpec, register_model


def build_tp_plan(**kwargs):
    """trainer/models/llama/tp_plan.py, imported when tensor parallelism is used (it imports DTensor, ~0.5 s)."""
    from trainer.models.llama.tp_plan import build_tp_plan as build

    return build(**kwargs)


register_model(
    ModelSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=FLAVORS,
        flops_per_token=llama_flops_per_token,
        build_tp_plan=build_tp_plan,
        tied_weights=TIED_WEIGHTS,
        tp_divisible=lambda args: {"n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads},
        positions=True,
        activation_bytes=llama_activation_bytes,
        validate_args=validate_llama_args,
        hf=hf.LlamaHF(),
    )
)

__all__ = ["LlamaArgs", "Transformer"]
