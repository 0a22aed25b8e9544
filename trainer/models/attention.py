"""Which keys each query may see, from the tokens' positions: a building block of the model families.

A family that takes ``positions`` (``ModelSpec.positions``) receives, per token, its position within its document
(a position 0 starts a document; windows pack documents end to end, so each document is one contiguous run). Query
q then sees the keys from the start of its document up to itself: global key indices ``q - positions[q]`` to ``q``.

The model asks for its mask with ``block_causal_mask`` and stays unaware of how its tokens are laid out: under
context parallelism a rank holds only some of each sequence's tokens (its queries) while attention runs over all of
them (the keys, gathered), and the context-parallel technique says so for the duration of a step with a
``SequenceLayout``. The mask is then (local queries x every key), built from the same positions.
"""

import torch


class SequenceLayout:
    """Where a rank's tokens sit in the whole sequence: ``query_index[j]`` is the global index of its token j,
    and attention runs over ``keys`` keys (the whole sequence, in global order). Within ``with layout:`` (which
    may be entered again and again), masks are built for these queries against all of the keys."""

    def __init__(self, query_index: torch.Tensor, keys: int):
        self.query_index, self.keys = query_index, keys

    def __enter__(self) -> "SequenceLayout":
        _LAYOUTS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _LAYOUTS.remove(self)


_LAYOUTS: list[SequenceLayout] = []


def query_and_key_index(queries: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(global index of each of the ``queries`` tokens, number of keys): the active layout's, else 0..queries-1."""
    if _LAYOUTS:
        layout = _LAYOUTS[-1]
        if layout.query_index.numel() != queries:
            raise ValueError(f"the sequence layout holds {layout.query_index.numel()} tokens, the model {queries}")
        return layout.query_index.to(device), layout.keys
    return torch.arange(queries, device=device), queries


def block_causal_mask(positions: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """(batch, seq) positions within documents -> (batch, 1, queries, keys) additive mask in ``dtype``: 0 where a
    query may see a key (same document, not later; within ``window`` tokens of it when given), -inf elsewhere.

    An additive mask in the activations' dtype, built once per forward and shared by the blocks, is what the
    attention kernel keeps for backward; a boolean one would be converted (and kept) anew by every layer."""
    query, keys = query_and_key_index(positions.shape[1], positions.device)
    key = torch.arange(keys, device=positions.device)
    first = (query - positions)[:, :, None]  # (batch, queries, 1): where each query's document starts
    allowed = (key <= query[:, None]) & (key >= first)
    if window is not None:
        allowed &= key > query[:, None] - window
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(
        ~allowed, float("-inf"))[:, None]
