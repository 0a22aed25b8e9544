"""Expert parallelism: each MoE layer's experts sharded over the ``ep`` ranks, tokens sent to the
rank holding their expert and the results sent back, by all-to-all (autograd-aware, any backend).

The model's ``MoE`` modules sort their (token, expert) pairs by expert and call ``dispatch`` with
the tokens, the count per expert and the local experts' compute; ``apply_ep`` installs a dispatch
that exchanges them. Expert weights become DTensors sharded on dim 0 (the expert index) over the
ep mesh, so checkpoints keep whole-model names and shapes and load on any ep degree.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.errors import ConfigError
from trainer.models.registry import ExpertLayer
from trainer.parallel.technique import ChunkSetup, PlanFacts, Technique


def expert_modules(model: nn.Module) -> list[ExpertLayer]:
    """The family's mixture-of-experts layers (``trainer.models.registry.ExpertLayer``)."""
    return [m for m in model.modules() if isinstance(m, ExpertLayer)]


class AllToAllDispatch:
    """Send each rank's tokens to the ranks holding their experts, compute there, and send the results back."""

    def __init__(self, group: dist.ProcessGroup, size: int, n_experts: int):
        self.group, self.size, self.local_experts = group, size, n_experts // size

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        # counts[e]: tokens this rank sends to expert e; experts are laid out rank by rank.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (source rank, local expert) counts
        received = received.view(self.size, self.local_experts)
        send = counts.view(self.size, self.local_experts).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = _wait(all_to_all_single_autograd(x, recv, send, self.group))
        # Rows arrive grouped by source rank, then by expert; the experts want them grouped by expert.
        expert_of_row = torch.arange(self.local_experts, device=x.device).repeat(self.size)
        expert_of_row = expert_of_row.repeat_interleave(received.flatten())
        order = expert_of_row.argsort(stable=True)
        out = compute(rows[order], received.sum(0))[order.argsort()]
        return _wait(all_to_all_single_autograd(out, send, recv, self.group))


def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard every MoE layer's experts over ``ep_mesh`` (model on the meta device); returns the expert parameters."""
    from torch.distributed.tensor import DTensor, Shard  # ~0.5 s of import: only in runs that use it

    size = ep_mesh.size()
    params = []
    for moe in expert_modules(model):
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            local = torch.empty((p.shape[0] // size, *p.shape[1:]), dtype=p.dtype, device=p.device)
            param = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False))
            setattr(moe.experts, name, param)
            params.append(param)
        moe.set_dispatch(AllToAllDispatch(ep_mesh.get_group(), size, moe.n_experts))
    return params


class ExpertParallel(Technique):
    """``[parallelism] expert_parallel_degree``: experts sharded over the ep ranks (carved from dp_shard); their
    FSDP averages their gradients over the fewer ranks that hold the same experts."""

    name = "ep"
    skips_stage_inference = True  # the inference's all-to-alls hang against peers of other stages (torch 2.13)

    def __init__(self, mesh: DeviceMesh, average: int):
        self.mesh, self.average = mesh, average
        self._params: list[nn.Parameter] | None = None

    @classmethod
    def check(cls, facts: PlanFacts) -> None:
        ep, spec = facts.dims.ep, facts.spec
        if ep == 1:
            return
        key = f"[parallelism] expert_parallel_degree={ep}"
        if spec.num_experts is None:
            raise ConfigError(f"{key}: model family {spec.name} has no experts")
        if spec.num_experts(facts.model_args) % ep:
            raise ConfigError(f"{key} must divide the model's n_experts={spec.num_experts(facts.model_args)}"
                              f" ({facts.family})")
        if facts.dims.pp > 1 and facts.dims.tp > 1:
            raise ConfigError(f"{key} with both pipeline_parallel_degree and tensor_parallel_degree > 1: not supported"
                              " yet; drop one of the three")

    @classmethod
    def build(cls, setup: ChunkSetup) -> "ExpertParallel | None":
        if setup.meshes.ep is None:
            return None
        return cls(setup.meshes.ep, setup.meshes.expert_grad_average)

    def apply(self, chunk: nn.Module) -> None:
        apply_ep(chunk, self.mesh)

    def own_gradient_average(self, chunks: nn.ModuleList) -> tuple[list[nn.Parameter], int]:
        if self._params is None:  # the parameters as training sees them: after FSDP has replaced them
            self._params = [p for m in expert_modules(chunks) for p in m.experts.parameters()]
        return self._params, self.average
