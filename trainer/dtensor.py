"""DTensor checks that do not import DTensor.

Importing ``torch.distributed.tensor`` costs ~0.5 s of start-up (measured), and a process that
never built a DTensor (one process, DDP, the launcher's config check) does not need it: no tensor
can be a DTensor before that module is imported.
"""

import sys

import torch


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as is."""
    return t.to_local() if is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective over its mesh); any other tensor as is."""
    return t.full_tensor() if is_dtensor(t) else t
