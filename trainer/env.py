"""One-time process set-up: logging, device choice, seeds and determinism."""

import logging
import os
import random

import torch

logger = logging.getLogger(__name__)


def device_type() -> str:
    """'cuda' (or another torch.accelerator backend) when one is present, else 'cpu'."""
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        return accel.current_accelerator().type
    return "cpu"


def init_device(local_rank: int) -> torch.device:
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, local_rank)
    torch.accelerator.set_device_index(local_rank)
    return device


def init_determinism(seed: int, deterministic: bool) -> None:
    """Seed every RNG the run touches; optionally forbid non-deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
