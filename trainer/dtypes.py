"""The one mapping from config dtype names (``"bfloat16"``, ...) to torch dtypes."""

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; names are those the schema's Literal fields accept."""
    return _DTYPES[name]
