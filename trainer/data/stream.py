"""Streaming sources (hub datasets read with streaming = true): packs documents into windows as they arrive.

Prepared token shards (trainer.data.loader) are the main path; this one serves sources that
cannot be prepared ahead because they are unbounded or too large to download.

Every rank reads the same global stream of windows: [BOS doc EOS BOS doc EOS ...] cut into
consecutive windows of ``seq_len + 1`` tokens (inputs are the first ``seq_len``, labels the
last ``seq_len``). A step consumes ``global_batch`` windows; data-parallel rank r keeps the
r-th contiguous slice and splits it into gradient-accumulation microbatches.

Because the stream does not depend on the layout, one process with gradient accumulation
sees exactly the same samples as N data-parallel ranks, and the position (epoch, document,
token offset) resumes on any layout. The price is that every data-parallel rank tokenizes
the whole stream: a cost that grows with the data-parallel degree (docs/training.md).
"""

import logging
from collections import deque
from dataclasses import dataclass

import torch

from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    """Tokens of one document that sit in the buffer, starting at ``offset`` of that document."""

    epoch: int
    doc: int
    offset: int
    length: int


class PackedBatchLoader:
    """Yields, per optimizer step, this rank's list of (inputs, labels) microbatches."""

    def __init__(
        self,
        documents,
        tokenizer: Tokenizer,
        *,
        text_column: str,
        seq_len: int,
        local_batch_size: int,
        accum_steps: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
    ):
        self.documents = documents
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.window = seq_len + 1
        self.local_batch_size = local_batch_size
        self.accum_steps = accum_steps
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.global_batch = local_batch_size * accum_steps * dp_degree
        self.load_state_dict({"epoch": 0, "doc": 0, "offset": 0})

    @property
    def fingerprint(self) -> str:
        return f"stream tokenizer={self.tokenizer.identity}"

    def shares(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to stop: this loader reads on the training thread (no prefetch)."""

    # -- position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """Position of the next window in the global stream; the same on every rank."""
        return {"epoch": self._epoch, "doc": self._doc, "offset": self._offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._doc, self._offset = state["epoch"], state["doc"], state["offset"]
        self._buffer: list[int] = []
        self._segments: deque[_Segment] = deque()
        self._docs = None  # (epoch, iterator of (index, text)), opened lazily at the position
        self._pending_offset = self._offset  # tokens of the first document already consumed
        self._last_read = (self._epoch, self._doc - 1)

    # -- reading ----------------------------------------------------------------------------
    def _open(self, epoch: int, start: int):
        docs = self.documents.skip(start) if start else self.documents
        return epoch, enumerate((row[self.text_column] for row in docs), start)

    def _fill(self) -> None:
        """Append the next document's tokens to the buffer, wrapping to a new epoch at the end."""
        if self._docs is None:
            self._docs = self._open(self._epoch, self._doc)
        epoch, it = self._docs
        from_start = self._last_read[1] < 0  # a pass that began at document 0
        while True:
            for index, text in it:
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise UserError(
                        f"[training.dataloader] text_column: document {index} holds {type(text).__name__}, not text"
                    )
                tokens = self.tokenizer.encode(text, bos=True, eos=True)
                skip, self._pending_offset = self._pending_offset, 0
                self._last_read = (epoch, index)
                self._docs = (epoch, it)
                if len(tokens) > skip:
                    self._buffer.extend(tokens[skip:])
                    self._segments.append(_Segment(epoch, index, skip, len(tokens) - skip))
                    return
            if from_start:
                raise UserError("[training] dataset: the dataset holds no text to train on")
            epoch += 1
            logger.info("dataset exhausted; starting epoch %d", epoch)
            _, it = self._open(epoch, 0)
            from_start = True

    def _next_window(self) -> list[int]:
        while len(self._buffer) < self.window:
            self._fill()
        window = self._buffer[: self.window]
        del self._buffer[: self.window]
        remaining = self.window  # advance the recorded position past the window's tokens
        while remaining:
            seg = self._segments[0]
            used = min(remaining, seg.length)
            seg.offset += used
            seg.length -= used
            remaining -= used
            if seg.length == 0:
                self._segments.popleft()
        if self._segments:
            head = self._segments[0]
            self._epoch, self._doc, self._offset = head.epoch, head.doc, head.offset
        else:  # the window ended exactly at the end of the last document read
            epoch, index = self._last_read
            self._epoch, self._doc, self._offset = epoch, index + 1, 0
        return window

    # -- batches ----------------------------------------------------------------------------
    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for one optimizer step: accum_steps pairs of (batch, seq_len)."""
        windows = [self._next_window() for _ in range(self.global_batch)]
        per_rank = self.global_batch // self.dp_degree
        mine = torch.tensor(windows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank], dtype=torch.long)
        micro = mine.split(self.local_batch_size)
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in micro]
