"""Streaming sources (hub datasets read with streaming = true): each rank tokenizes only its own documents.

Prepared token shards (trainer.data.loader) are the main path; this one serves sources that
cannot be prepared ahead because they are unbounded or too large to download.

**Lanes.** A step consumes B = local_batch_size x accum_steps x dp windows of ``seq_len + 1``
tokens (inputs are the first ``seq_len``, labels the last ``seq_len``). The stream is dealt
into B lanes: document i of an epoch goes to lane i % B, and each lane packs its own documents,
[BOS doc EOS BOS doc EOS ...], into consecutive windows. Step s takes the next window of every
lane; lane j is row j of the global batch, and data-parallel rank r keeps the rows
[r B / dp, (r + 1) B / dp), split into gradient-accumulation microbatches. A rank therefore
tokenizes only the documents of its own lanes, 1/dp of the text; it still reads every row of
the stream to find them (reading a row is cheap next to tokenizing it).

The order depends on B and not on how B is split, so one process with accumulation sees exactly
the samples of N data-parallel ranks. The position is per lane (epoch, document, token offset);
each rank saves its own lanes and a resumed run reads them all back, so resume is exact on any
layout with the same global batch. With another global batch (another number of lanes), every
lane restarts at the earliest unfinished document of the saved lanes, with a warning: nothing is
skipped, some text is seen twice.
"""

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    """Tokens of one document that sit in a lane's buffer, starting at ``offset`` of that document."""

    epoch: int
    doc: int
    offset: int
    length: int


@dataclass
class _Pass:
    """One pass over the stream, from document ``count`` on: which of this rank's lanes it gave text."""

    epoch: int
    documents: object  # iterator of (index, text)
    whole: bool  # began at document 0
    count: int = 0  # documents seen so far (the index after the last one)
    fed: set = field(default_factory=set)


@dataclass
class _Lane:
    """One lane: its position (the next unconsumed token: document ``doc`` of ``epoch``, token
    ``offset``) and the tokens read ahead of it."""

    epoch: int
    doc: int
    offset: int
    tokens: list[int] = field(default_factory=list)
    start: int = 0  # tokens[:start] are consumed (dropped in bulk, so long documents stay linear)
    segments: deque = field(default_factory=deque)
    last: tuple[int, int] | None = None  # (epoch, doc) of the last document appended

    @property
    def buffered(self) -> int:
        return len(self.tokens) - self.start


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
        self.global_batch = local_batch_size * accum_steps * dp_degree  # = the number of lanes
        per_rank = local_batch_size * accum_steps
        self.mine = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        self.tokenized = 0  # documents this rank has tokenized (the cost lanes divide by dp)
        self.load_state_dict({})

    @property
    def fingerprint(self) -> str:
        return f"stream tokenizer={self.tokenizer.identity}"

    def shares(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to stop: this loader reads on the training thread (no prefetch)."""

    # -- position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The number of lanes and the position of each of this rank's lanes (other ranks save theirs)."""
        state = {"lanes": self.global_batch}
        for j in self.mine:
            lane = self._lanes[j]
            state.update({f"lane{j}.epoch": lane.epoch, f"lane{j}.doc": lane.doc, f"lane{j}.offset": lane.offset})
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Every saved lane's position (or {} for the start of the stream)."""
        if "windows" in state:
            raise UserError("[checkpoint] the checkpoint's data position is from prepared (sharded) data, not a"
                            " stream; add 'dataloader' to [checkpoint] exclude_from_loading to start the data from"
                            " the beginning")
        lanes = self.global_batch
        if not state:
            starts = {j: (0, j, 0) for j in self.mine}
        elif state.get("lanes") == lanes:
            starts = {j: (state[f"lane{j}.epoch"], state[f"lane{j}.doc"], state[f"lane{j}.offset"]) for j in self.mine}
        else:
            if "lanes" in state:
                saved = [(state[f"lane{k}.epoch"], state[f"lane{k}.doc"]) for k in range(state["lanes"])]
            else:  # one position for the whole stream, as saved before lanes
                saved = [(state["epoch"], state["doc"])]
            epoch, doc = min(saved)
            logger.warning("the data position was saved with %s lanes (windows per global batch), this run has %d:"
                           " every lane restarts at document %d of epoch %d (some text is seen twice)",
                           state.get("lanes", "no"), lanes, doc, epoch)
            # lane j's first document at or after the restart point
            starts = {j: (epoch, doc + (j - doc) % lanes, 0) for j in self.mine}
        self._lanes = {j: _Lane(*starts[j]) for j in self.mine}
        self._reader: _Pass | None = None  # opened lazily, at the earliest lane position

    # -- reading ----------------------------------------------------------------------------
    def _open(self, epoch: int, start: int) -> "_Pass":
        docs = self.documents.skip(start) if start else self.documents
        return _Pass(epoch, enumerate((row[self.text_column] for row in docs), start), whole=start == 0)

    def _read(self) -> None:
        """Tokenize the next document of the stream that belongs to one of this rank's lanes (at or
        after that lane's position), wrapping to a new epoch at the end of the stream."""
        if self._reader is None:
            epoch, doc = min((lane.epoch, lane.doc) for lane in self._lanes.values())
            self._reader = self._open(epoch, doc)
        while True:
            read = self._reader
            for index, text in read.documents:
                read.count = index + 1
                lane = self._lanes.get(index % self.global_batch)
                if lane is None or (read.epoch, index) < (lane.epoch, lane.doc) or text is None:
                    continue
                if not isinstance(text, str):
                    raise UserError(
                        f"[training.dataloader] text_column: document {index} holds {type(text).__name__}, not text"
                    )
                tokens = self.tokenizer.encode(text, bos=True, eos=True)
                self.tokenized += 1
                skip = lane.offset if (read.epoch, index) == (lane.epoch, lane.doc) else 0
                lane.last = (read.epoch, index)
                if len(tokens) > skip:
                    lane.tokens.extend(tokens[skip:])
                    lane.segments.append(_Segment(read.epoch, index, skip, len(tokens) - skip))
                    read.fed.add(index % self.global_batch)
                    return
            if read.whole:
                self._check_pass(read)
            logger.info("dataset exhausted; starting epoch %d", read.epoch + 1)
            self._reader = self._open(read.epoch + 1, 0)

    def _check_pass(self, read: "_Pass") -> None:
        """After a whole pass over the stream, every lane of this rank must have been given text
        (else the lane would wait forever)."""
        def waits_on_this_pass(lane: _Lane) -> bool:  # it takes every document of its turn in this epoch
            return (lane.epoch, lane.doc) < (read.epoch, self.global_batch)

        starving = [j for j in self.mine if j not in read.fed and waits_on_this_pass(self._lanes[j])]
        if not starving:
            return
        if read.count <= starving[-1]:
            raise UserError(
                f"[training] dataset: the stream holds {read.count} documents, fewer than the {self.global_batch}"
                " windows of a global batch (streaming deals the documents to the windows in turn); use a larger"
                " dataset or [training.dataloader] streaming = false"
            )
        if not read.fed:
            raise UserError("[training] dataset: the dataset holds no text to train on")
        raise UserError(
            f"[training] dataset: documents {starving[0]}, {starving[0] + self.global_batch}, ... (every"
            f" {self.global_batch}-th, one window of the global batch) hold no text; use [training.dataloader]"
            " streaming = false"
        )

    def _next_window(self, lane: _Lane) -> list[int]:
        while lane.buffered < self.window:
            self._read()
        window = lane.tokens[lane.start: lane.start + self.window]
        lane.start += self.window
        if lane.start > len(lane.tokens) // 2:  # drop consumed tokens in bulk: linear in the document length
            del lane.tokens[: lane.start]
            lane.start = 0
        remaining = self.window  # advance the lane's position past the window's tokens
        while remaining:
            seg = lane.segments[0]
            used = min(remaining, seg.length)
            seg.offset += used
            seg.length -= used
            remaining -= used
            if seg.length == 0:
                lane.segments.popleft()
        if lane.segments:
            head = lane.segments[0]
            lane.epoch, lane.doc, lane.offset = head.epoch, head.doc, head.offset
        else:  # the window ended exactly at the end of the last document read: the lane's next one
            epoch, index = lane.last
            lane.epoch, lane.doc, lane.offset = epoch, index + self.global_batch, 0
        return window

    # -- batches ----------------------------------------------------------------------------
    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches for one optimizer step: accum_steps pairs of (batch, seq_len)."""
        mine = torch.tensor([self._next_window(self._lanes[j]) for j in self.mine], dtype=torch.long)
        return [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in mine.split(self.local_batch_size)]
