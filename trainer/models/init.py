"""Deterministic, layout-independent parameter initialisation.

Each parameter is drawn in full from a generator seeded by (seed, parameter name), then the
rank keeps only its own shard. So a parameter gets the same values whether the model runs
in one process, is split into pipeline chunks, or is sharded by FSDP or tensor parallelism.
"""

import hashlib
from collections.abc import Callable

import torch

from trainer.dtensor import is_dtensor, local_tensor
from trainer.models.tied import find_tied, retie_

InitFn = Callable[[torch.Tensor, torch.Generator], None]


def seed_for(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole-parameter tensor ``full`` into ``param``, keeping only this rank's shard if sharded."""
    local = local_tensor(param)
    full = full.to(device=local.device, dtype=local.dtype)
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the same full tensor, so just slice, no comms.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


@torch.no_grad()
def init_param_(param: torch.Tensor, name: str, seed: int, fn: InitFn) -> None:
    """Fill ``param`` (plain or DTensor) with ``fn`` applied to the full tensor."""
    device = local_tensor(param).device
    gen = torch.Generator(device=device).manual_seed(seed_for(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32, device=device)
    fn(full, gen)
    copy_full_(param, full)


def materialize_(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model (plain, TP- or FSDP-sharded) on ``device`` and initialise it."""
    tied = find_tied(model)
    model.to_empty(device=device)
    retie_(model, tied)  # to_empty allocates shared parameters once per owner
    model.init_weights(seed)


def normal_(std: float, *, truncate: float | None = None) -> InitFn:
    """Normal(0, std), optionally truncated at +-truncate*std."""

    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        if truncate is None:
            t.normal_(0.0, std, generator=gen)
        else:
            torch.nn.init.trunc_normal_(t, 0.0, std, -truncate * std, truncate * std, generator=gen)

    return fn


def constant_(value: float) -> InitFn:
    def fn(t: torch.Tensor, gen: torch.Generator) -> None:
        t.fill_(value)

    return fn
