"""The one mapping from config dtype names (``"bfloat16"``, ...) to torch dtypes."""

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; names are those the schema's Literal fields accept."""
    return _DTYPES[name]


def compute_dtype(mixed_precision_param: str, device: str) -> torch.dtype:
    """``[training] mixed_precision_param``: auto = bfloat16 on accelerators, float32 on CPU."""
    if mixed_precision_param == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return torch_dtype(mixed_precision_param)
