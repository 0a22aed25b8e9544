"""The built-in mixture-of-experts family, registered as ``[model] name = "moe"``."""

from trainer.models.decoder.model import TIED_WEIGHTS
from trainer.models.moe import hf
from trainer.models.moe.args import FLAVORS, MoEArgs, validate_moe_args
from trainer.models.moe.model import (MoE, MoETransformer, moe_activation_bytes, moe_after_step, moe_flops_per_token,
                                      moe_idle_params)
from trainer.models.decoder.spec import decoder_job_limits
from trainer.models.registry import ModelSpec, register_model


def moe_job_limits(args: MoEArgs, dims) -> str | None:
    if why := decoder_job_limits(args, dims):
        return why
    if dims.cp > 1 and args.aux_loss_coef > 0:
        return (f"[parallelism] context_parallel_degree={dims.cp} with a mixture of experts: the sequence-wise"
                f" balance loss ([model.overrides] aux_loss_coef = {args.aux_loss_coef:g}) is computed over each whole"
                " sequence; set aux_loss_coef = 0 (balancing by bias_update_speed needs no whole sequences)")
    return None


def build_tp_plan(**kwargs):
    """trainer/models/moe/tp_plan.py, imported when tensor parallelism is used (it imports DTensor, ~0.5 s)."""
    from trainer.models.moe.tp_plan import build_tp_plan as build

    return build(**kwargs)


def moe_spec(name: str, flavors: dict[str, MoEArgs], hf_adapter) -> ModelSpec:
    """The ModelSpec of a mixture-of-experts family: ``flavors`` its presets, ``hf_adapter`` its checkpoint mapping."""
    return ModelSpec(
        name=name,
        model_cls=MoETransformer,
        flavors=flavors,
        flops_per_token=moe_flops_per_token,
        activation_bytes=moe_activation_bytes,
        build_tp_plan=build_tp_plan,
        auto_tp=False,
        tied_weights=TIED_WEIGHTS,
        tp_divisible=lambda args: {"n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads},
        positions=True,
        job_limits=moe_job_limits,
        validate_args=validate_moe_args,
        after_step=moe_after_step,
        num_experts=lambda args: args.n_experts,
        idle_params=moe_idle_params,
        hf=hf_adapter,
    )


register_model(moe_spec("moe", FLAVORS, hf.MoEHF()))

__all__ = ["MoE", "MoEArgs", "MoETransformer", "moe_spec"]
