"""What autograd saves for backward during a step (``[profiling] activation_memory_steps``)."""

import torch


class SavedActivationMeter:
    """What autograd keeps for backward during one step, in bytes: the live total's peak.

    A saved-tensor hook sees every tensor an operation saves; each storage counts once however
    many operations save it or views of it, from the first save until autograd drops its last
    reference (after the backward that used it). Parameters and buffers (also gathered FSDP
    parameters and their transposed views) are not activations and are left out. Tensors kept
    by activation checkpointing's own frames are invisible to the hook, so under AC this counts
    only what the non-checkpointed code saves. Under autocast (bf16 without FSDP), the low-precision
    copies of the weights that matmuls save are not parameters and are counted (an overcount by up to
    the model's bf16 size); CPU runs in float32 have no such copies.
    """

    def __init__(self, chunks) -> None:
        self._exclude = {_local(t).untyped_storage().data_ptr()
                         for chunk in chunks for t in [*chunk.parameters(), *chunk.buffers()]}
        self._live: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self.current = self.peak = 0

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        local = _local(tensor)
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor
        storage = local.untyped_storage()
        address = storage.data_ptr()
        if address == 0 or address in self._exclude:  # empty, or a parameter/buffer of the model
            return tensor
        entry = self._live.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        # detached: a saved output keeps its grad_fn, which holds this object: a cycle through autograd's
        # C++ graph that no collector sees (seen to keep split-backward schedules' tensors alive)
        return _Held(tensor.detach(), self, address)

    def _release(self, address: int) -> None:
        entry = self._live[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[address]


class _Held:
    """A saved tensor as autograd stores it while metered; dropping it releases its bytes."""

    __slots__ = ("tensor", "meter", "address")

    def __init__(self, tensor: torch.Tensor, meter: SavedActivationMeter, address: int) -> None:
        self.tensor, self.meter, self.address = tensor, meter, address

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __del__(self) -> None:
        self.meter._release(self.address)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the data of a DTensor or another wrapper subclass (e.g. a collective's result)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        tensor = getattr(tensor, tensor.__tensor_flatten__()[0][0])
    return tensor
