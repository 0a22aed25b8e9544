"""Token shards on disk: what ``prepare`` writes and the loader memory-maps.

A prepared dataset is a folder::

    index.json          what the shards hold and which tokenizer made them
    tokens-00000.bin    token ids, little-endian uint16 (vocabulary <= 65536) or uint32
    docs-00000.bin      uint64 end offset of each document within its shard

The token stream is every document as [BOS text EOS] (BOS where the tokenizer has one),
concatenated in source order; shards end at document boundaries. Files are written to a
temporary folder and renamed into place, so a folder with an ``index.json`` is complete, and
nothing in them depends on the time or the machine: preparing the same input twice gives
identical bytes.
"""

import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.errors import UserError
from trainer.jsonfile import count, entry, file_name, read_json, say_unknown

logger = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT = "trainer.token_shards"
VERSION = 1
SHARD_TOKENS = 1 << 28  # tokens per shard file before a new one starts (512 MiB in uint16)
BATCH_DOCS = 512  # documents tokenized per batch (the tokenizer spreads a batch over all cores)


@dataclass(frozen=True)
class ShardInfo:
    tokens: str
    docs: str
    num_tokens: int
    num_documents: int
    sha256: str


class TokenShards:
    """A prepared folder, opened: one memory-mapped stream of ``num_tokens`` tokens."""

    def __init__(self, folder: str | Path, *, key: str = "[training] dataset_path"):
        self.folder = Path(folder)
        self.key = key
        index_path = self.folder / INDEX
        if not index_path.exists() and not index_path.is_symlink():
            if self.folder.is_file():
                raise UserError(f"{key}: {self.folder} is a file, not a folder prepared with python -m trainer.prepare")
            raise UserError(f"{key}: {self.folder} has no {INDEX}; prepare it with python -m trainer.prepare")
        index = read_json(index_path, key, what=f"{FORMAT} index")
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise UserError(f"{key}: {index_path} is not a version-{VERSION} {FORMAT} index")
        say_unknown(index, ("format", "version", "source", "tokenizer", "dtype", "num_documents", "num_tokens",
                            "shards"), index_path, key)
        tokenizer = entry(index, "tokenizer", dict, index_path, key)
        self.tokenizer_identity: str = entry(tokenizer, "identity", str, index_path, key, where="tokenizer.identity")
        self.vocab_size: int = count(tokenizer, "vocab_size", index_path, key, where="tokenizer.vocab_size")
        dtype = entry(index, "dtype", str, index_path, key)
        if dtype not in ("uint16", "uint32"):
            raise UserError(f"{key}: {index_path} dtype = {dtype!r}: must be 'uint16' or 'uint32'")
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.source: str = entry(index, "source", str, index_path, key, required=False) or ""
        self.shards = []
        for i, shard in enumerate(entry(index, "shards", list, index_path, key)):
            at = f"shards[{i}]"
            if not isinstance(shard, dict):
                raise UserError(f"{key}: {index_path} {at} = {shard!r}: expected an object")
            say_unknown(shard, ShardInfo.__dataclass_fields__, index_path, key, where=at)
            self.shards.append(ShardInfo(
                tokens=file_name(shard, "tokens", index_path, key, where=f"{at}.tokens"),
                docs=file_name(shard, "docs", index_path, key, where=f"{at}.docs"),
                num_tokens=count(shard, "num_tokens", index_path, key, where=f"{at}.num_tokens"),
                num_documents=count(shard, "num_documents", index_path, key, where=f"{at}.num_documents"),
                sha256=entry(shard, "sha256", str, index_path, key, where=f"{at}.sha256")))
        self.fingerprint = hashlib.sha256(index_path.read_bytes()).hexdigest()[:16]
        self._maps: list[np.ndarray] = []
        for shard in self.shards:
            path = self.folder / shard.tokens
            expected = shard.num_tokens * self.dtype.itemsize
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise UserError(f"{key}: shard file {path} listed in {INDEX} is missing") from None
            if size != expected:
                raise UserError(
                    f"{key}: shard file {path} holds {size} bytes, but {INDEX} says {shard.num_tokens} tokens"
                    f" ({expected} bytes); it is truncated or from another preparation"
                )
            self._maps.append(np.memmap(path, dtype=self.dtype, mode="r") if expected else np.zeros(0, self.dtype))
        self.num_tokens = sum(s.num_tokens for s in self.shards)
        self.num_documents = sum(s.num_documents for s in self.shards)
        self._starts = np.cumsum([0] + [s.num_tokens for s in self.shards])
        if self.num_tokens == 0:
            raise UserError(f"{key}: {self.folder} holds no tokens (the dataset is empty)")

    def verify(self) -> None:
        """Hash every token file against the sha256 the index recorded at preparation (reads the whole
        dataset once: run ``python -m trainer.prepare --verify FOLDER`` after copying data, not
        at every start, where only the sizes are checked)."""
        for shard in self.shards:
            path = self.folder / shard.tokens
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != shard.sha256:
                raise UserError(f"{self.key}: shard file {path} has other contents than when it was prepared"
                                f" (sha256 {digest[:12]}..., {INDEX} says {shard.sha256[:12]}...)")

    def check_tokenizer(self, identity: str, vocab_size: int) -> None:
        """Refuse shards made by another tokenizer: token ids would mean other text."""
        if identity != self.tokenizer_identity or vocab_size != self.vocab_size:
            raise UserError(
                f"{self.key}: {self.folder} was prepared with tokenizer {self.tokenizer_identity} (vocabulary"
                f" {self.vocab_size}), but [model] uses {identity} (vocabulary {vocab_size}); prepare it again"
            )

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream (within one epoch), possibly across shards."""
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._starts[i])
            take = min(length - filled, self.shards[i].num_tokens - offset)
            part = out[filled:filled + take]
            part[:] = self._maps[i][offset:offset + take]
            # A damaged file (a flipped byte) holds ids the embedding has no row for: name the file, not
            # an index error deep in the model. One max over the window: cheap next to the step.
            if take and ((hi := int(part.max())) >= self.vocab_size or (lo := int(part.min())) < 0):
                bad = hi if hi >= self.vocab_size else lo
                raise UserError(f"{self.key}: shard file {self.folder / self.shards[i].tokens} holds token id {bad}"
                                f" at token {offset + int(np.argmax(part == bad))}, outside the vocabulary of"
                                f" {self.vocab_size}: the file is damaged (check it with python -m"
                                f" trainer.prepare --verify {self.folder})")
            filled += take
            i += 1
        return out


def iter_texts(documents, text_column: str, key: str) -> Iterator[str]:
    """The documents' text in order; missing text (None) is skipped, anything else not text is an error."""
    for index, row in enumerate(documents):
        text = row[text_column]
        if text is None:
            continue
        if not isinstance(text, str):
            raise UserError(f"{key}: document {index} holds {type(text).__name__}, not text")
        yield text


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_shards(texts: Iterable[str], tokenizer, out: str | Path, *, source: str, shard_tokens: int = SHARD_TOKENS,
                   show_progress: bool | None = None) -> dict:
    """Tokenize ``texts`` into a shard folder ``out`` (which must not exist yet). Returns a summary:
    documents, tokens, seconds, tokens per second."""
    out = Path(out)
    if (out / INDEX).exists():
        raise UserError(f"output folder {out} already holds a prepared dataset; remove it or choose another")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        what = "a folder holding other files" if out.is_dir() else "a file"
        raise UserError(f"output folder {out} is {what}; choose a new folder")
    dtype = np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<u4")
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        raise UserError(f"output folder {out}: cannot create {tmp.parent}: {e.strerror or e}") from None
    shards: list[dict] = []
    start = time.perf_counter()
    num_docs = num_tokens = 0
    progress = _progress(show_progress)
    tokens_file = docs_file = None
    shard_tok = shard_docs = 0
    digest = None

    def close_shard():
        nonlocal tokens_file, docs_file
        tokens_file.close()
        docs_file.close()
        n = len(shards)
        shards.append({"tokens": f"tokens-{n:05d}.bin", "docs": f"docs-{n:05d}.bin", "num_tokens": shard_tok,
                       "num_documents": shard_docs, "sha256": digest.hexdigest()})
        tokens_file = docs_file = None

    try:
        for batch in _batches(texts, BATCH_DOCS):
            for ids in tokenizer.encode_documents(batch):
                if tokens_file is None:
                    n = len(shards)
                    tokens_file = open(tmp / f"tokens-{n:05d}.bin", "wb")  # noqa: SIM115 (closed in close_shard)
                    docs_file = open(tmp / f"docs-{n:05d}.bin", "wb")  # noqa: SIM115
                    shard_tok = shard_docs = 0
                    digest = hashlib.sha256()
                data = np.asarray(ids, dtype=dtype).tobytes()
                tokens_file.write(data)
                digest.update(data)
                shard_tok += len(ids)
                shard_docs += 1
                docs_file.write(np.uint64(shard_tok).astype("<u8").tobytes())
                num_docs += 1
                num_tokens += len(ids)
                if shard_tok >= shard_tokens:
                    close_shard()
            progress(num_docs, num_tokens)
        if tokens_file is not None:
            close_shard()
        if num_tokens == 0:
            raise UserError(f"{source}: the dataset holds no text to prepare")
        index = {"format": FORMAT, "version": VERSION, "source": source,
                 "tokenizer": {"identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size},
                 "dtype": dtype.name, "num_documents": num_docs, "num_tokens": num_tokens, "shards": shards}
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        try:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # an empty folder made for it: rename replaces nothing on every platform
            tmp.rename(out)
        except OSError as e:
            if not (out / INDEX).exists():  # another process won the race with identical files: keep theirs
                raise UserError(f"output folder {out}: cannot publish the prepared dataset there:"
                                f" {e.strerror or e}") from None
    finally:
        if tokens_file is not None:
            tokens_file.close()
            docs_file.close()
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        progress(None, None)
    seconds = time.perf_counter() - start
    return {"documents": num_docs, "tokens": num_tokens, "shards": len(shards), "seconds": seconds,
            "tokens_per_second": num_tokens / max(seconds, 1e-9)}


def _progress(show: bool | None):
    """A callable (documents, tokens) -> None showing progress: a bar on stderr when it is a terminal (or ``show``),
    else a log line every half minute; (None, None) ends it."""
    if show is None:
        show = sys.stderr.isatty()
    if not show:  # a log file: a line every half minute instead of a bar
        from trainer.log import Progress

        lines = Progress("tokenizing", unit="documents")
        return lambda docs, tokens: None if docs is None else lines.update(docs, f"{tokens:,} tokens")
    from tqdm import tqdm

    bar = tqdm(unit=" docs", desc="tokenizing", file=sys.stderr)

    def update(docs, tokens):
        if docs is None:
            bar.close()
            return
        bar.update(docs - bar.n)
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)

    return update
