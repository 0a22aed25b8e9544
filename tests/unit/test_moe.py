"""The mixture-of-experts family: routing, dispatch with empty experts, load balancing, FLOPs, and the
Hugging Face export computing the same logits as transformers' Qwen3MoeForCausalLM."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from trainer.hf import export_hf, load_hf_
from trainer.models import get_model_spec
from trainer.models.init import materialize_
from trainer.models.moe.args import MoEArgs
from trainer.models.moe.model import (
    MoE,
    Router,
    grouped_mm_dtype,
    grouped_swiglu,
    looped_swiglu,
    moe_after_step,
    moe_layers,
    sequence_balance_loss,
)

SPEC = get_model_spec("moe")
TINY = MoEArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, n_dense_layers=1, dense_hidden_dim=48,
               n_experts=4, top_k=2, expert_hidden_dim=16, max_seq_len=16)


def build(args=TINY, seed=0):
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    materialize_(model, torch.device("cpu"), seed)
    return model


def test_router_picks_the_top_k_and_breaks_ties_towards_the_lower_expert():
    router = Router(dataclasses.replace(TINY, n_experts=4, top_k=2, dim=4))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 5.0, 1.0]])
    weights, experts, scores = router(x)
    assert experts.tolist() == [[1, 3], [0, 1], [2, 3]]  # exact ties: lower index first
    torch.testing.assert_close(scores, x.softmax(-1))
    chosen = x.softmax(-1).gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))  # norm_topk


def test_router_ties_among_many_experts_follow_the_expert_index():
    """64 experts with many exact ties: an unstable sort (or topk) orders equal scores differently on CPU at
    this size (seen: 64 ties, unstable order differs), so only a stable, index-ordered choice passes."""
    n = 64
    router = Router(dataclasses.replace(TINY, n_experts=n, top_k=8, dim=n))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(n))
    x = torch.stack([torch.zeros(n), (torch.arange(n) % 2 == 0).float(), (torch.arange(n) % 3).float()])
    _, experts, _ = router(x)
    expected = [sorted(range(n), key=lambda i, row=row: (-row[i], i))[:8] for row in x.tolist()]
    assert experts.tolist() == expected


def test_the_balancing_bias_steers_the_choice_but_not_the_weights():
    args = dataclasses.replace(TINY, dim=4, bias_update_speed=1e-3, score_func="sigmoid", norm_topk=False,
                               route_scale=2.5)
    router = Router(args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    x = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    weights, experts, _ = router(x)
    assert experts.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, 2.5 * x.sigmoid()[:, [3, 0]])


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, combined with the router's weights placed in a dense matrix."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts, _ = moe.router(flat)
    gates = torch.zeros(flat.shape[0], moe.n_experts).scatter(1, experts, weights)
    e = moe.experts
    h = F.silu(torch.einsum("td,ehd->teh", flat, e.w1)) * torch.einsum("td,ehd->teh", flat, e.w3)
    out = torch.einsum("teh,edh->ted", h, e.w2)
    return (out * gates.unsqueeze(-1)).sum(1).view_as(x)


def test_dispatch_matches_the_dense_computation_even_with_empty_experts():
    model = build()
    moe = model.layers["1"].moe
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # every token prefers experts 1 and 2: experts 0 and 3 get nothing
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[1, 0] = moe.router.gate.weight[2, 1] = 1.0
        x[..., 0] = x[..., 0].abs() + 10
        x[..., 1] = x[..., 1].abs() + 10
    ours = moe(x)
    torch.testing.assert_close(ours, dense_reference(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.tokens_per_expert.tolist() == [0, 16, 16, 0]
    ours.square().sum().backward()
    g = moe.experts.w1.grad
    assert g[0].abs().sum() == 0 and g[3].abs().sum() == 0 and g[1].abs().sum() > 0


def test_an_empty_rank_still_gives_the_experts_zero_gradients():
    w1, w3, w2 = (torch.randn(2, 8, 4, requires_grad=True), torch.randn(2, 8, 4, requires_grad=True),
                  torch.randn(2, 4, 8, requires_grad=True))
    out = looped_swiglu(torch.zeros(0, 4), torch.tensor([0, 0]), w1, w2, w3)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1))


def test_grouped_gemm_path_equals_the_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    ws = [torch.randn(4, 16, 8, generator=gen), torch.randn(4, 8, 16, generator=gen),
          torch.randn(4, 16, 8, generator=gen)]
    counts = torch.tensor([5, 0, 3, 4])  # an empty expert in the middle
    w_loop = [w.clone().requires_grad_() for w in ws]
    w_grp = [w.clone().requires_grad_() for w in ws]
    a = looped_swiglu(x, counts, *w_loop)
    b = grouped_swiglu(x, counts, *w_grp)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    grad = torch.randn(a.shape, generator=gen)  # a dense gradient (torch's CPU kernel refuses an expanded one)
    a.backward(grad)
    b.backward(grad)
    for p, q in zip(w_loop, w_grp, strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device, dtype, autocast, expected", [
    ("cuda", torch.bfloat16, None, torch.bfloat16),  # FSDP's mixed precision: bf16 tokens and weights
    ("cuda", torch.float32, torch.bfloat16, torch.bfloat16),  # one GPU: autocast, float32 tokens from the norm
    ("cuda", torch.float32, None, None),  # float32 training: the loop
    ("cuda", torch.float32, torch.float16, None),  # fp16 autocast: the loop (grouped_mm takes bf16)
    ("cpu", torch.bfloat16, torch.bfloat16, None),  # CPU: the loop
])
def test_the_experts_run_grouped_mm_on_cuda_in_bf16_with_or_without_autocast(device, dtype, autocast, expected):
    """The first GPU run found the grouped kernel skipped on one GPU: autocast leaves the routed tokens in float32,
    and only bf16 tokens were sent to it (tests/unit/test_cuda.py runs the real path on CUDA)."""
    assert grouped_mm_dtype(device, dtype, autocast) is expected


def test_bias_update_moves_towards_equal_load_and_resets_the_counts():
    model = build(dataclasses.replace(TINY, bias_update_speed=0.01))
    moe = model.layers["1"].moe
    moe.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    seen = []
    metrics = moe_after_step(model, lambda t: (seen.append(t.clone()), t.mul_(2))[1])  # as if 2 ranks agree
    assert seen[0].shape == (2, 4 + 2)  # both MoE layers in one reduction
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert metrics["load_max_over_mean/layer1"] == pytest.approx(2.0)
    assert moe.tokens_per_expert.sum() == 0


def test_activation_checkpointing_does_not_count_tokens_twice():
    from torch.utils.checkpoint import checkpoint

    # With the auxiliary loss, the recomputation runs past the counting (torch stops recomputing once
    # it has every saved tensor, which without it comes before the counting).
    model = build(dataclasses.replace(TINY, aux_loss_coef=0.01)).train()
    moe = model.layers["1"].moe
    x = torch.randn(2, 8, 32, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 2 * 8 * TINY.top_k
    assert moe.aux_loss_sum[1] == 2
    with torch.no_grad():
        model.eval()
        moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 8 * TINY.top_k  # evaluation does not count


def test_aux_loss_gradient_is_that_of_the_explicit_objective():
    args = dataclasses.replace(TINY, aux_loss_coef=0.1)
    a, b = build(args).train(), build(dataclasses.replace(args, aux_loss_coef=0.0)).train()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    a.layers["1"].moe(x).sum().backward()
    moe_b = b.layers["1"].moe
    out = moe_b(x)
    _, experts, scores = moe_b.router(x.reshape(-1, 32))
    explicit = out.sum() + 0.1 * 8 * sequence_balance_loss(scores, experts, 2, 4).sum()
    explicit.backward()
    ga, gb = a.layers["1"].moe.router.gate.weight.grad, moe_b.router.gate.weight.grad
    torch.testing.assert_close(ga, gb)
    assert a.layers["1"].moe.aux_loss_sum[1] == 2  # two sequences recorded for the metric


def test_sequence_balance_loss_is_one_when_perfectly_balanced():
    # 4 tokens, 2 experts, top-1: each expert chosen twice, uniform scores -> f = 1, P = 0.5 -> 2 * 0.5 = 1
    scores = torch.full((4, 2), 0.5)
    experts = torch.tensor([[0], [1], [0], [1]])
    assert sequence_balance_loss(scores, experts, 1, 2).item() == pytest.approx(1.0)


def test_flops_count_active_parameters_only():
    with torch.device("meta"):
        model = SPEC.model_cls(TINY)
    seq = 16
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for layer in moe_layers(model).values() for p in layer.experts.parameters())
    active = matmul + experts * TINY.top_k / TINY.n_experts
    attention_scores = 12 * TINY.n_layers * TINY.n_heads * TINY.head_dim * seq
    assert SPEC.flops_per_token(TINY, seq) == pytest.approx(6 * active + attention_scores)


def test_pipeline_cost_model_counts_the_chosen_experts_only():
    from trainer.pipeline.split import module_costs

    with torch.device("meta"):
        model = SPEC.model_cls(TINY)
    pre, blocks, post = module_costs(model, SPEC.layout(TINY), mode="flops", seq_len=16)
    # forward = a third of training FLOPs, block by block as in flops_per_token
    assert 3 * (pre + sum(blocks) + post) == pytest.approx(SPEC.flops_per_token(TINY, 16))
    expert = 2 * 3 * TINY.dim * TINY.expert_hidden_dim
    dense_ffn = 2 * 3 * TINY.dim * TINY.dense_hidden_dim
    router = 2 * TINY.dim * TINY.n_experts
    assert blocks[1] - blocks[0] == pytest.approx(TINY.top_k * expert + router - dense_ffn)


def test_export_loads_in_transformers_qwen3_moe_with_the_same_logits(tmp_path):
    args = dataclasses.replace(TINY, n_layers=3, n_dense_layers=1)
    model = build(args).eval()
    with torch.no_grad():  # norms away from 1, so that a wrong layout of the per-head q/k norms shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    export_hf([model], SPEC, args, tmp_path, torch.float32, pp_rank=0, pp=1, writer=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    other = build(args, seed=1).eval()
    load_hf_([other], SPEC, args, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(other(tokens), ours, rtol=0, atol=0)


@pytest.mark.parametrize("args, world, message", [
    (["--parallelism.expert_parallel_degree", "3"], 4,
     r"expert_parallel_degree=3 must divide data_parallel_shard_degree=4"),
    (["--parallelism.expert_parallel_degree", "2", "--model.overrides.n_experts", "3", "--model.overrides.top_k", "1"],
     2, r"expert_parallel_degree=2 must divide the model's n_experts=3"),
    (["--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"], 4,
     r"expert_parallel_degree=2 with context_parallel_degree=2: not supported yet"),
    (["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.tensor_parallel_degree", "2"], 8,
     r"with both pipeline_parallel_degree and tensor_parallel_degree"),
    (["--model.flavor", "debugmodel_shared", "--checkpoint.export_hf"], 1,
     r"\[checkpoint\] export_hf: .* n_shared_experts > 0"),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.tensor_parallel_plan", "auto"], 2,
     r"tensor_parallel_plan = \"auto\": model family moe must use its own plan"),
    (["--model.overrides.top_k", "9"], 1, r"\[model.overrides\] top_k=9: must be <= n_experts=8"),
    (["--model.overrides.score_func", "relu"], 1, r"score_func='relu': must be 'softmax' or 'sigmoid'"),
])
def test_bad_moe_settings_are_one_line_naming_the_key(args, world, message):
    from tests.conftest import load_plan
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_plan(["--model.name", "moe"] + args, world)


def test_a_family_without_experts_refuses_expert_parallelism():
    from tests.conftest import load_plan
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="model family llama3 has no experts"):
        load_plan(["--parallelism.expert_parallel_degree", "2"], 2)


EP_DISPATCH = """
import os, torch, torch.distributed as dist
from trainer.parallel.ep import AllToAllDispatch
dist.init_process_group("gloo")
rank = dist.get_rank()
# 4 experts, 2 per rank. Rank r's rows are sorted by expert with these counts; row i holds 100 r + i. Each
# rank receives its rows grouped by source rank (0 then 1), not by expert: [e0, e1, e1, e0, e0, e1] on rank 0.
counts = torch.tensor([[1, 2, 2, 1], [2, 1, 1, 2]][rank])
x = (100 * rank + torch.arange(int(counts.sum()), dtype=torch.float32)).unsqueeze(1).repeat(1, 3)

def compute(rows, per_local_expert):
    # each local expert adds 1000 x its global index to the rows it receives
    local = torch.arange(len(per_local_expert)).repeat_interleave(per_local_expert)
    return rows + 1000.0 * (2 * rank + local).unsqueeze(1)

out = AllToAllDispatch(dist.group.WORLD, 2, 4)(x, counts, compute)
expert = torch.arange(4).repeat_interleave(counts)
assert torch.equal(out, x + 1000.0 * expert.unsqueeze(1).float()), (rank, out[:, 0].tolist())
print("ok", rank, flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_expert_dispatch_returns_each_row_computed_by_its_expert_in_its_own_place(tmp_path, launch_tmp):
    """Two gloo ranks: every row comes back to its rank and position, computed by the expert it was sent to
    (a wrong combine order, or rows handed to the wrong local expert, changes the values)."""
    import os
    import subprocess
    import sys

    from tests.distributed.harness import REPO

    script = tmp_path / "dispatch.py"
    script.write_text(EP_DISPATCH)
    # torchrun's logs in tmp_path: without --log-dir it leaves a folder in /tmp at each launch
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun"), str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          # the script lives in tmp_path: the trainer from this checkout, installed or not
                          env={**os.environ, "OMP_NUM_THREADS": "1", **launch_tmp.env,
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stderr[-2000:]
    assert not launch_tmp.left()
