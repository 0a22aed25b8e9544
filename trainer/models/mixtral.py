"""The Mixtral family (``mixtral``): the mixture-of-experts decoder with softmax top-k routing over every block, no
shared experts, no q/k norm, and the published layout (``block_sparse_moe.gate`` and one ``w1``/``w2``/``w3`` per
expert)."""

from dataclasses import dataclass, field

from trainer.models.decoder.hf import base_args, beyond, refuse_unless, require, rope_args
from trainer.models.moe import moe_spec
from trainer.models.moe.args import MoEArgs
from trainer.models.moe.hf import MoEHF, experts_beyond
from trainer.models.registry import register_model

_EXPERTS = {"moe.experts.w1": "w1", "moe.experts.w3": "w3", "moe.experts.w2": "w2"}


def mixtral_args(config: dict, base: MoEArgs) -> dict:
    refuse_unless(config, {"hidden_act": ("silu",), "router_jitter_noise": (0.0, 0)}, "mixtral")
    args = base_args(config, "mixtral")
    window = config.get("sliding_window")
    return {**args, **rope_args(config), "qk_norm": "none", "n_dense_layers": 0,
            "expert_hidden_dim": args.pop("ffn_hidden_override"), "n_experts": require(config, "num_local_experts"),
            "top_k": require(config, "num_experts_per_tok"), "norm_topk": True, "n_shared_experts": 0,
            "score_func": "softmax", "route_scale": 1.0, "bias_update_speed": 0.0,
            "sliding_window": int(window) if window is not None else 0, "global_every": 0}


def _write(a: MoEArgs) -> dict:
    return {"intermediate_size": a.expert_hidden_dim, "num_local_experts": a.n_experts,
            "num_experts_per_tok": a.top_k, "router_aux_loss_coef": a.aux_loss_coef, "hidden_act": "silu",
            "sliding_window": a.sliding_window or None}


def _why_not(a: MoEArgs) -> str | None:
    if a.n_dense_layers or a.n_shared_experts or a.bias_update_speed or a.expert_bias or a.n_expert_groups > 1 \
            or a.score_func != "softmax" \
            or not a.norm_topk or a.route_scale != 1.0:
        return ("a dense block, shared experts, a balancing bias or routing other than softmax top-k renormalised"
                " (Mixtral routes softmax top-k in every block)")
    return experts_beyond(a, "MixtralForCausalLM") or beyond(a, "MixtralForCausalLM", {"sliding_window"})


@dataclass
class MixtralHF(MoEHF):
    model_type: str = "mixtral"
    architecture: str = "MixtralForCausalLM"
    moe_module: str = "block_sparse_moe"
    expert_names: dict = field(default_factory=lambda: dict(_EXPERTS))

    def __post_init__(self):
        self.from_config, self.write_config, self.why_not = mixtral_args, _write, _why_not


def _flavor(**kw) -> MoEArgs:
    return MoEArgs(qk_norm="none", n_dense_layers=0, norm_topk=True, norm_eps=1e-5, **kw)


FLAVORS = {
    "debugmodel": _flavor(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=2048, n_experts=8, top_k=2,
                          expert_hidden_dim=256, rope_theta=1e6),
    # config.json of mistralai/Mixtral-8x7B-v0.1
    "8x7B": _flavor(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, n_experts=8, top_k=2,
                    expert_hidden_dim=14336, rope_theta=1e6),
}
register_model(moe_spec("mixtral", FLAVORS, MixtralHF()))
