"""Reads each step's windows from prepared token shards: per rank, ahead of the step, resumable anywhere.

A dataset's token stream is cut into ``n`` windows of ``seq_len + 1`` tokens (inputs are the first
``seq_len``, labels the last ``seq_len``; the tail shorter than a window is not used). The job
consumes a global sequence of windows, numbered 0, 1, 2, ...; which window of which dataset
global window ``g`` is, is a pure function of ``(seed, g)`` (``WindowOrder.locate``):

- mixing: the datasets' weights are apportioned over a block of ``MIX_BLOCK`` windows and
  interleaved smoothly inside it; block after block repeats that pattern, so every dataset's
  share stays within 1/MIX_BLOCK of its weight at every point of the stream;
- epochs: dataset k's c-th window is window ``c mod n_k`` of its epoch ``c div n_k``;
- shuffling (optional): within an epoch, windows are permuted by a keyed Feistel network on the
  window index (a bijection computed per index, no permutation table in memory).

Step s uses global windows [s * B, (s + 1) * B) for a global batch of B sequences, and
data-parallel rank r reads only its slice, so the cost of a step's data is independent of the
data-parallel degree, and one process with gradient accumulation sees exactly the windows of N
ranks. The position is one number, the windows consumed, so resume is exact on any layout.
"""

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from trainer.data.shards import TokenShards
from trainer.errors import UserError

logger = logging.getLogger(__name__)

MIX_BLOCK = 10_000


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 values."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    k = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    for p in parts:
        with np.errstate(over="ignore"):
            k = _mix64(k ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF))
    return k[0]


def feistel_permute(index: np.ndarray, n: int, key: np.uint64, rounds: int = 4) -> np.ndarray:
    """A permutation of range(n) applied to ``index`` (values < n): balanced Feistel network over the
    smallest even power of two >= n, cycle-walking values that land outside range(n)."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    x = index.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        y = x[todo]
        left, right = y >> half, y & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix64(right ^ _mix64(np.full_like(right, key + np.uint64(r)))) & mask)
        y = (left << half) | right
        x[todo] = y
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def mix_pattern(weights: list[float], block: int = MIX_BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset of each slot of a block, that dataset's count before the slot, windows per dataset per block).

    Counts per block are the weights apportioned by largest remainder; slots are dealt to the
    dataset furthest behind its share so far (ties to the lower index), so shares are smooth."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    quota = w * block
    counts = np.floor(quota).astype(np.int64)
    for k in np.argsort(-(quota - counts), kind="stable")[: block - counts.sum()]:
        counts[k] += 1
    slots = np.empty(block, dtype=np.int64)
    before = np.empty(block, dtype=np.int64)
    taken = np.zeros(len(w), dtype=np.int64)
    for j in range(block):
        k = int(np.argmax((j + 1) * counts / block - taken))
        slots[j], before[j] = k, taken[k]
        taken[k] += 1
    return slots, before, counts


class WindowOrder:
    """Which (dataset, window) each global window index is: a pure function of (seed, index)."""

    def __init__(self, datasets: list[TokenShards], weights: list[float], window: int, *, seed: int,
                 shuffle: bool, names: list[str]):
        self.datasets, self.window, self.seed, self.shuffle, self.names = datasets, window, seed, shuffle, names
        self.num_windows = [d.num_tokens // window for d in datasets]
        for d, n in zip(datasets, self.num_windows):
            if n == 0:
                raise UserError(f"{d.key}: {d.folder} holds {d.num_tokens} tokens, fewer than one window of"
                                f" [training] seq_len + 1 = {window}")
        if len(datasets) == 1:
            self.slots, self.before, self.per_block = np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)
        else:
            self.slots, self.before, self.per_block = mix_pattern(weights)
            for name, c, w in zip(names, self.per_block, weights):
                if c == 0:
                    raise UserError(f"[training] dataset_mix: weight {w} of {name!r} is too small to be sampled"
                                    f" (below 1/{MIX_BLOCK} of the total)")

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, window index within that dataset's stream) of global windows ``g``."""
        block = len(self.slots)
        j = g % block
        k = self.slots[j]
        c = (g // block) * self.per_block[k] + self.before[j]
        window = np.empty_like(c)
        for d, n in enumerate(self.num_windows):
            sel = k == d
            if not sel.any():
                continue
            epoch, i = np.divmod(c[sel], n)
            if self.shuffle:
                for e in np.unique(epoch):
                    at = epoch == e
                    i[at] = feistel_permute(i[at], n, _key(self.seed, d, int(e)))
            window[sel] = i
        return k, window

    def counts(self, g: int) -> np.ndarray:
        """Windows taken from each dataset among the first ``g`` global windows."""
        block = len(self.slots)
        full, rest = divmod(g, block)
        return full * self.per_block + np.bincount(self.slots[:rest], minlength=len(self.per_block))

    def read(self, g: np.ndarray) -> torch.Tensor:
        """Token windows of global windows ``g``: (len(g), window) int64."""
        k, i = self.locate(g)
        out = np.stack([self.datasets[d].read(int(w) * self.window, self.window) for d, w in zip(k, i)])
        return torch.from_numpy(out)


class WindowLoader:
    """Yields, per optimizer step, this rank's list of (inputs, labels) microbatches, read ahead in a thread."""

    def __init__(self, order: WindowOrder, *, local_batch_size: int, accum_steps: int, dp_rank: int = 0,
                 dp_degree: int = 1, prefetch: bool = True):
        self.order = order
        self.local_batch_size, self.accum_steps = local_batch_size, accum_steps
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.per_rank = local_batch_size * accum_steps
        self.global_batch = self.per_rank * dp_degree
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="data") if prefetch else None
        self._ahead: tuple[int, Future] | None = None
        self.consumed = 0  # global windows handed out

    def state_dict(self) -> dict[str, int]:
        """Position in the global window sequence; the same on every rank."""
        return {"windows": self.consumed, "window_tokens": self.order.window}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "windows" not in state:
            raise UserError("[checkpoint] the checkpoint's data position is from the streaming loader; add"
                            " 'dataloader' to [checkpoint] exclude_from_loading to start the data from the beginning")
        consumed, window = state["windows"], state.get("window_tokens", self.order.window)
        if window != self.order.window:  # seq_len changed: keep the tokens consumed, in new windows
            logger.warning("resuming with seq_len + 1 = %d instead of %d: data position converted by tokens",
                           self.order.window, window)
            consumed = -(-consumed * window // self.order.window)
        self.consumed = consumed
        self._ahead = None

    def _step_batch(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first = start + self.dp_rank * self.per_rank
        mine = self.order.read(np.arange(first, first + self.per_rank, dtype=np.int64))
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in mine.split(self.local_batch_size)]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for one optimizer step: accum_steps pairs of (batch, seq_len)."""
        start = self.consumed
        if self._ahead is not None and self._ahead[0] == start:
            batch = self._ahead[1].result()
        else:
            batch = self._step_batch(start)
        self.consumed = start + self.global_batch
        if self._pool is not None:
            self._ahead = (self.consumed, self._pool.submit(self._step_batch, self.consumed))
        return batch

    @property
    def fingerprint(self) -> str:
        """What this loader reads, for the check that every rank opened the same data."""
        parts = [d.fingerprint for d in self.order.datasets]
        return f"shards={','.join(parts)} seed={self.order.seed} shuffle={self.order.shuffle}"

    def shares(self) -> dict[str, float]:
        """Achieved fraction of the windows consumed so far per dataset (by name)."""
        counts = self.order.counts(self.consumed)
        total = max(int(counts.sum()), 1)
        return {name: int(c) / total for name, c in zip(self.order.names, counts)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
