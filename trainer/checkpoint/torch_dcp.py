"""The seams to torch.distributed.checkpoint (DCP), imported at the first save or load: it imports DTensor
and FSDP (~0.6 s), which a run that has not reached a checkpoint does not need."""

import warnings

# DCP says this on every save and load of a one-process run, which is expected here and tells the user nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def dcp():
    """torch.distributed.checkpoint with its state_dict helpers."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict.*)

    return dcp


def optim_options():
    return dcp().state_dict.StateDictOptions(flatten_optimizer_state_dict=True)


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises on failure: its CheckpointException (a BaseException, gathered from every
    rank) or an ordinary exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def first_failure(error: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (rank -> (exception, traceback)), else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error
