"""What only a CUDA device can show: the grouped-GEMM expert kernel in bf16, the expert path under autocast, and
pinned checkpoint staging. Collected only with TRAINER_TEST_DEVICE=cuda (conftest); the CPU halves of the same
logic are tested elsewhere (test_moe, test_checkpoint)."""

import dataclasses

import pytest
import torch

from trainer.models import get_model_spec
from trainer.models.init import materialize_
from trainer.models.moe import model as moe_model
from trainer.models.moe.args import MoEArgs

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
TINY = MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, n_experts=8, top_k=2,
               expert_hidden_dim=32, max_seq_len=16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_grouped_mm_equals_the_per_expert_loop_in_bf16_with_an_empty_expert():
    """Forward and every gradient of torch._grouped_mm against the loop, both bf16 on CUDA, and both against
    float64 on the CPU: bf16 operands round to ~4e-3 relative, so 2e-2 bounds both and catches a wrong grouping
    (a token's rows multiplied by another expert's weights is off by ~1.4, the norm of a difference of two
    independent products)."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 25, 7, 56])  # an empty expert in the middle; offsets need no alignment
    x = torch.randn(int(counts.sum()), 64, generator=gen)
    ws = [torch.randn(5, 96, 64, generator=gen) / 8, torch.randn(5, 64, 96, generator=gen) / 10,
          torch.randn(5, 96, 64, generator=gen) / 8]
    grad = torch.randn(x.shape[0], 64, generator=gen)
    results = {}
    for name, kernel, device, dtype in (("grouped", moe_model.grouped_swiglu, CUDA, torch.bfloat16),
                                        ("loop", moe_model.looped_swiglu, CUDA, torch.bfloat16),
                                        ("exact", moe_model.looped_swiglu, torch.device("cpu"), torch.float64)):
        xi = x.to(device, dtype).requires_grad_()
        wi = [w.to(device, dtype).requires_grad_() for w in ws]
        out = kernel(xi, counts.to(device), *wi)
        out.backward(grad.to(device, dtype))
        results[name] = [t.detach().cpu() for t in (out, xi.grad, *(w.grad for w in wi))]
    for name in ("grouped", "loop"):
        for i, (got, want) in enumerate(zip(results[name], results["exact"], strict=True)):
            assert rel(got, want) < 2e-2, (name, i, rel(got, want))
    for w_grad in results["grouped"][2:]:  # the empty expert's weights get an exact zero gradient
        assert not w_grad[1].any() and w_grad[0].any()


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_the_experts_take_grouped_mm_on_cuda_bf16_unless_told_not_to(monkeypatch, use_grouped_mm):
    calls = []
    real = moe_model.grouped_swiglu
    monkeypatch.setattr(moe_model, "grouped_swiglu", lambda *a: calls.append(1) or real(*a))
    args = dataclasses.replace(TINY, use_grouped_mm=use_grouped_mm)
    with torch.device("meta"):
        model = get_model_spec("moe").model_cls(args)
    materialize_(model, CUDA, 0)
    tokens = torch.randint(0, 128, (2, 16), device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # one GPU's mixed precision: float32 weights, autocast
        model(tokens).float().sum().backward()
    assert len(calls) == (2 if use_grouped_mm else 0)  # once per MoE layer, or never
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_pinned_staging_copies_cuda_tensors_into_page_locked_buffers(tmp_path):
    """DCP's stager as the checkpointer uses it: the staged copies are pinned CPU tensors equal to the CUDA ones;
    where torch keeps its buffers, a second save of the same tensors reuses them, else it gets a new stager."""
    from trainer.checkpoint.torch_dcp import pinned_stager, stager_keeps_buffers

    state = {"w": torch.randn(256, 128, device=CUDA), "step": 3}
    stager = pinned_stager()
    first = stager.stage(state)
    assert first["w"].device.type == "cpu" and first["w"].is_pinned()
    assert torch.equal(first["w"], state["w"].cpu()) and first["step"] == 3
    state["w"].mul_(2)
    if not stager_keeps_buffers():
        stager = pinned_stager()
    second = stager.stage(state)
    assert second["w"].is_pinned() and torch.equal(second["w"], state["w"].cpu())
    if stager_keeps_buffers():
        assert second["w"].data_ptr() == first["w"].data_ptr()  # the buffer is kept, not allocated anew
    stager.close()
