"""The DeepSeek-V3 family's pieces on their own: grouped top-k routing and its choosing bias against hand-worked
cases, the bias kept by checkpoints and moved by training after an import, float8 block-scaled weights dequantized
on import, and the FLOP count of latent attention. (Logits, generation and export against transformers:
tests/integration/test_families.py; parallel layouts: tests/distributed/test_moe_family_parity.py.)"""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.errors import UserError
from trainer.hf import export_hf, load_hf_
from trainer.models import get_model_spec
from trainer.models.init import materialize_
from trainer.models.moe.model import Router, moe_after_step

SPEC = get_model_spec("deepseek_v3")
TINY = dataclasses.replace(SPEC.flavors["debugmodel"], dim=32, n_layers=2, n_heads=2, vocab_size=64, kv_lora_rank=8,
                           q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
                           head_dim_override=8, dense_hidden_dim=48, expert_hidden_dim=16, max_seq_len=16)


def build(args=TINY):
    model = SPEC.meta_model(args)
    materialize_(model, torch.device("cpu"), 0)
    return model


def router_with_scores(scores: list[float], **kw) -> tuple[Router, torch.Tensor]:
    """A router over len(scores) experts whose sigmoid scores for the returned token are ``scores``."""
    n = len(scores)
    args = dataclasses.replace(TINY, **{"dim": n, "n_experts": n, "top_k": 2, "n_expert_groups": 4, "topk_groups": 2,
                                        "route_scale": 2.5, **kw})
    router = Router(args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(n))
    return router, torch.logit(torch.tensor([scores], dtype=torch.float64)).float()


# Groups of two: sums of their two scores 1.0, 1.15, 0.9, 0.65 -> groups 1 and 0 compete; among experts 0-3 the
# best two are 0 (0.9) and 2 (0.6). Without groups, 0 and 4 (0.85) would win.
SCORES = [0.9, 0.1, 0.6, 0.55, 0.85, 0.05, 0.3, 0.35]


def test_grouped_top_k_chooses_within_the_best_groups():
    router, x = router_with_scores(SCORES)
    weights, experts, _ = router(x)
    assert experts.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.9, 0.6]]) / 1.5 * 2.5)
    ungrouped, x = router_with_scores(SCORES, n_expert_groups=1, topk_groups=1)
    assert ungrouped(x)[1].tolist() == [[0, 4]]


def test_the_choosing_bias_ranks_the_groups_and_the_experts_but_not_the_weights():
    router, x = router_with_scores(SCORES)
    with torch.no_grad():  # expert 5: 0.05 + 0.9 = 0.95, so group 2 sums 0.85 + 0.95 = 1.8 and leads group 1 (1.15)
        router.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0.9, 0, 0]))
    weights, experts, _ = router(x)
    assert experts.tolist() == [[5, 4]]
    torch.testing.assert_close(weights, torch.tensor([[0.05, 0.85]]) / 0.9 * 2.5)


def test_an_imported_bias_is_kept_by_checkpoints_and_moved_by_training(tmp_path):
    """The bias is a checkpointed buffer even with bias_update_speed = 0 (expert_bias: read from HF, written back);
    with a speed it moves by speed * sign(mean load - load) per step from the value it was loaded with."""
    model = build(dataclasses.replace(TINY, bias_update_speed=0.0))
    key = "layers.1.moe.router.expert_bias"
    assert key in model.state_dict()
    bias = torch.arange(8.0) / 10
    export_hf([model], SPEC, TINY, tmp_path / "hf", torch.float32, pp_rank=0, pp=1, writer=True)
    tensors = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, tmp_path / "hf" / "model-00001-of-00001.safetensors")
    moving = build(dataclasses.replace(TINY, bias_update_speed=0.01))
    load_hf_([moving], SPEC, TINY, tmp_path / "hf")
    moe = moving.layers["1"].moe
    assert moe.router.expert_bias.tolist() == bias.tolist()
    moe.tokens_per_expert.copy_(torch.tensor([4.0, 0, 2, 2, 2, 2, 3, 1]))  # mean 2
    moe_after_step(moving, lambda t: t)
    torch.testing.assert_close(moe.router.expert_bias, bias + 0.01 * torch.tensor([-1.0, 1, 0, 0, 0, 0, -1, 1]))
    resumed = build(dataclasses.replace(TINY, bias_update_speed=0.01))
    resumed.load_state_dict(moving.state_dict())
    assert resumed.layers["1"].moe.router.expert_bias.tolist() == moe.router.expert_bias.tolist()


def blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """Dequantized block by block, the definition written out."""
    out = torch.empty(weight.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = weight[rows, cols].float() * scale_inv[i, j]
    return out


def test_float8_block_scaled_weights_are_dequantized_on_import(tmp_path):
    """A folder whose kv_b projection is float8 with 4x4 block scales (config.json weight_block_size; a last block
    cut short: 12 rows of 8 columns): the loaded weight is each block times its scale."""
    model = build()
    folder = tmp_path / "hf"
    export_hf([model], SPEC, TINY, folder, torch.float32, pp_rank=0, pp=1, writer=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").unlink()  # the names come from the file itself
    file = folder / "model-00001-of-00001.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    full = tensors[name]
    assert full.shape == (2 * (4 + 6), 8)  # 20 rows: 5 blocks, 2 blocks of columns
    amax = full.abs().unflatten(0, (5, 4)).unflatten(2, (2, 4)).amax(dim=(1, 3))
    scale_inv = amax / 448  # each block's largest value at float8's largest
    quantized = (full / scale_inv.repeat_interleave(4, 0).repeat_interleave(4, 1)).to(torch.float8_e4m3fn)
    save_file({**tensors, name: quantized, name + "_scale_inv": scale_inv}, file)
    fresh = build()
    load_hf_([fresh], SPEC, TINY, folder)
    torch.testing.assert_close(fresh.layers["0"].attention.wkv_b.weight, blockwise(quantized, scale_inv, 4),
                               rtol=0, atol=0)
    torch.testing.assert_close(fresh.layers["0"].attention.wkv_b.weight, full, rtol=0.07, atol=0.01 * full.abs().max())

    save_file({**tensors, name: quantized, name + "_scale_inv": scale_inv[:4]}, file)
    with pytest.raises(UserError, match=r"kv_b_proj.weight_scale_inv has shape \(4, 2\): 4x4 blocks of a 20x8 "
                                        r"weight take \(5, 2\)"):
        load_hf_([fresh], SPEC, TINY, folder)
    save_file({**tensors, name: quantized}, file)
    with pytest.raises(UserError, match=r"is torch.float8_e4m3fn without a .*kv_b_proj.weight_scale_inv"):
        load_hf_([fresh], SPEC, TINY, folder)


def test_flops_count_latent_attention():
    """6 per matmul weight a token uses (attention's low-rank and per-head projections, the dense block, the router
    and k + shared experts, the output) plus 6 * heads * (q/k size + v size) per key."""
    from trainer.models.moe.model import moe_flops_per_token

    a, seq = TINY, 16
    model = build()
    attn = sum(p.numel() for n, p in model.layers["0"].attention.named_parameters() if "norm" not in n)
    dense = sum(p.numel() for p in model.layers["0"].feed_forward.parameters())
    moe = model.layers["1"].moe
    routed = sum(p[0].numel() for p in moe.experts.parameters()) * a.top_k
    shared = sum(p.numel() for p in moe.shared_experts.parameters())
    weights = 2 * attn + dense + moe.router.gate.weight.numel() + routed + shared + model.output.weight.numel()
    scores = 6 * a.n_heads * (8 + 6) * seq * a.n_layers
    assert moe_flops_per_token(a, seq) == 6 * weights + scores


def test_a_bfloat16_export_keeps_the_choosing_bias_in_float32(tmp_path):
    """transformers keeps e_score_correction_bias in float32; rounded to bfloat16 (3 significant digits) a bias can
    change which experts are chosen."""
    model = build()
    bias = torch.full((8,), 1.0) + torch.arange(8.0) * 1e-4  # distinct in float32, equal in bfloat16
    model.layers["1"].moe.router.expert_bias.copy_(bias)
    export_hf([model], SPEC, TINY, tmp_path / "hf", torch.bfloat16, pp_rank=0, pp=1, writer=True)
    tensors = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].tolist() == bias.tolist()
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("family, option, value", [
    ("deepseek_v3", "expert_activation", "swiglu_clamped"), ("deepseek_v3", "expert_biases", True),
    ("gpt_oss", "n_expert_groups", 2), ("mixtral", "n_expert_groups", 2), ("mixtral", "expert_bias", True),
    ("moe", "router_bias", True),
])
def test_an_export_that_would_drop_a_routing_or_expert_option_is_refused(family, option, value):
    """Each class can hold only its own options: exported anyway, transformers would compute another model."""
    spec = get_model_spec(family)
    assert spec.hf.why_not(spec.flavors["debugmodel"]) is None
    assert spec.hf.why_not(dataclasses.replace(spec.flavors["debugmodel"], **{option: value}))


def test_the_multi_token_prediction_layer_left_unread_is_said(caplog):
    from transformers import DeepseekV3Config

    from trainer.models.deepseek import deepseek_args

    config = DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1, hidden_size=64, num_attention_heads=4,
                              vocab_size=100, num_nextn_predict_layers=1).to_dict()
    with caplog.at_level("WARNING"):
        deepseek_args(config, SPEC.flavors["debugmodel"])
    assert "num_nextn_predict_layers = 1: the multi-token-prediction layer is not read" in caplog.text
