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


def pinned_stager():
    """DCP's stager that copies the state into page-locked (pinned) host buffers, which the device copies into at
    full speed; it keeps them for the next save where torch allows (``stager_keeps_buffers``). CUDA only."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))


def stager_keeps_buffers() -> bool:
    """Whether one DCP stager serves every save: torch 2.13's keeps its pinned buffers for the next save; 2.11's
    empties its copier at the end of each (a second save through it raises KeyError: <class 'type'>, seen on an
    H200 with torch 2.11), so there each save gets a stager of its own and allocates its pinned buffers anew."""
    import torch

    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


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
