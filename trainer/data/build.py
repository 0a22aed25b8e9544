"""From the config's dataset keys to a loader: open prepared shards, or prepare raw text once, then read.

Raw text (the bundled documents, local files, a downloaded hub dataset) is tokenized into shards
in ``[training.dataloader] cache_folder`` before the first step, by local rank 0 of each node while
the other ranks wait; later runs with the same source and tokenizer reuse the shards. Hub
datasets read with ``streaming = true`` cannot be prepared ahead and use the streaming loader.
"""

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from trainer.config.schema import DataLoader, Training, Validation
from trainer.config.validate import is_prepared_path, mix_entries
from trainer.data.loader import WindowLoader, WindowOrder
from trainer.data.shards import INDEX, TokenShards, iter_texts, prepare_shards
from trainer.data.sources import BUNDLED, Source, load_documents, local_files, training_source
from trainer.data.stream import PackedBatchLoader
from trainer.errors import UserError

logger = logging.getLogger(__name__)


def _cache_name(source: Source, opts: DataLoader, tokenizer) -> str:
    """Folder name for the shards of ``source``: changes with the text, its reading options and the tokenizer."""
    what: dict = {"tokenizer": tokenizer.identity, "split": source.split, "text_column": opts.text_column}
    if source.dataset_path:
        files = local_files(source)
        what["files"] = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    elif source.dataset == BUNDLED:
        what["bundled"] = sys.version  # the documentation topics change with the Python version
    else:
        what["hub"] = (source.dataset, opts.subset)
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(source.name.rstrip("/")).name or "data"
    return f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in stem)}-{digest}"


def open_source(source: Source, opts: DataLoader, tokenizer, *, cache: Path, wait_seconds: float) -> TokenShards:
    """The shards of ``source``: prepared ones as they are, raw text prepared into ``cache`` first."""
    if is_prepared_path(source.dataset_path):
        shards = TokenShards(source.dataset_path, key=source.path_key)
    else:
        folder = cache / _cache_name(source, opts, tokenizer)
        if not (folder / INDEX).is_file():
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                logger.info("preparing %s into %s", source.name, folder)
                docs = load_documents(source, opts)
                if hasattr(docs, "__len__") and len(docs) == 0:
                    raise UserError(f"{source.split_key}={source.split!r}: selects no documents of {source.name}")
                try:
                    summary = prepare_shards(iter_texts(docs, opts.text_column, "[training.dataloader] text_column"),
                                             tokenizer, folder, source=source.name)
                    logger.info("prepared %s: %d documents, %d tokens in %.1f s (%.0f tokens/s)", source.name,
                                summary["documents"], summary["tokens"], summary["seconds"],
                                summary["tokens_per_second"])
                except UserError:
                    if not (folder / INDEX).is_file():
                        raise
                    # Another node's local rank 0 published it first (a dump folder shared by the nodes).
                    logger.info("%s was prepared by another node meanwhile; using it", folder)
            else:
                _wait_for(folder / INDEX, wait_seconds, source)
        shards = TokenShards(folder, key=source.path_key)
    shards.check_tokenizer(tokenizer.identity, tokenizer.vocab_size)
    return shards


def _wait_for(index: Path, seconds: float, source: Source) -> None:
    deadline = time.monotonic() + seconds
    while not index.is_file():
        if time.monotonic() > deadline:
            raise UserError(
                f"{source.section} dataset: waited {seconds:.0f} s ([comm] init_timeout_seconds) for local rank 0 to"
                f" prepare {source.name}; prepare it ahead with python -m trainer.prepare"
            )
        time.sleep(0.2)


def _mix_sources(training: Training) -> list[tuple[Source, float]]:
    if not training.dataset_mix:
        return [(training_source(training), 1.0)]
    out = []
    for entry in mix_entries(training):
        local = entry.name != BUNDLED and Path(entry.name).exists()
        if entry.own_split and is_prepared_path(entry.name):
            raise UserError(f"[training.dataset_mix] {entry.name!r}: split {entry.split!r} cannot apply to prepared"
                            f" token shards (they are read whole); prepare the split you want with"
                            f" python -m trainer.prepare")
        out.append((Source("" if local else entry.name, entry.name if local else "", entry.split,
                           section="[training.dataset_mix]", split_key=entry.split_key), entry.weight))
    return out


def _log_mix(training: Training, shards: list[TokenShards]) -> None:
    """The mix as it will be read: every dataset's weight, split (and where that split is set) and size."""
    entries = mix_entries(training)
    total = sum(e.weight for e in entries)
    logger.info("data mix of %d datasets (a split set by [training.dataloader] split applies to every dataset"
                " without its own):", len(entries))
    for e, s in zip(entries, shards):
        split = ("prepared shards, read whole" if is_prepared_path(e.name)
                 else f"split {e.split!r} ({'its own' if e.own_split else e.split_key})")
        logger.info("  %s: weight %g (%.1f%% of windows), %s, %s documents, %s tokens", e.name, e.weight,
                    100 * e.weight / total, split, f"{s.num_documents:,}", f"{s.num_tokens:,}")


def build_train_loader(training: Training, tokenizer, *, dump_folder: str, seed: int, accum_steps: int,
                       dp_rank: int, dp_degree: int, wait_seconds: float) -> WindowLoader | PackedBatchLoader:
    """The training loader for ``[training]``: shards (prepared, or raw text prepared now) or a stream."""
    opts = training.dataloader
    sources = _mix_sources(training)
    streamed = [s for s, _ in sources if not s.dataset_path and s.dataset != BUNDLED and opts.streaming]
    if streamed:  # a single streamed hub dataset (the mix refuses streaming at config time)
        logger.info("[training.dataloader] streaming = true: each rank tokenizes the documents of its own windows"
                    " (and reads every row to find them)")
        return PackedBatchLoader(
            load_documents(sources[0][0], opts), tokenizer, text_column=opts.text_column, seq_len=training.seq_len,
            local_batch_size=training.local_batch_size, accum_steps=accum_steps, dp_rank=dp_rank, dp_degree=dp_degree)
    cache = Path(dump_folder) / opts.cache_folder
    shards = [open_source(s, opts, tokenizer, cache=cache, wait_seconds=wait_seconds) for s, _ in sources]
    order = WindowOrder(shards, [w for _, w in sources], training.seq_len + 1, seed=seed, shuffle=opts.shuffle,
                        names=[s.name for s, _ in sources])
    if training.dataset_mix:
        _log_mix(training, shards)
    return WindowLoader(order, local_batch_size=training.local_batch_size, accum_steps=accum_steps,
                        dp_rank=dp_rank, dp_degree=dp_degree, prefetch=opts.prefetch)


def build_eval_loader(validation: Validation, training: Training, tokenizer, *, dump_folder: str, accum_steps: int,
                      dp_rank: int, dp_degree: int, wait_seconds: float) -> tuple[WindowLoader, int]:
    """The validation loader (source order, no shuffle, the training batch shape) and its global batches per
    evaluation."""
    source = Source(validation.dataset, validation.dataset_path, validation.split, section="[validation]",
                    split_key="[validation] split")
    opts = training.dataloader
    if not source.dataset_path and source.dataset != BUNDLED and opts.streaming:
        opts = replace(opts, streaming=False)  # evaluation needs a fixed, prepared set
    shards = open_source(source, opts, tokenizer, cache=Path(dump_folder) / opts.cache_folder,
                         wait_seconds=wait_seconds)
    order = WindowOrder([shards], [1.0], training.seq_len + 1, seed=0, shuffle=False, names=[source.name])
    loader = WindowLoader(order, local_batch_size=training.local_batch_size, accum_steps=accum_steps,
                          dp_rank=dp_rank, dp_degree=dp_degree, prefetch=False)
    available = order.num_windows[0] // loader.global_batch
    if available == 0:
        raise UserError(
            f"[validation] dataset: {source.name} holds {order.num_windows[0]} windows of seq_len + 1 ="
            f" {order.window} tokens, fewer than one global batch of {loader.global_batch}"
        )
    if validation.steps == -1:
        return loader, available
    if validation.steps > available:
        logger.warning("[validation] steps=%d exceeds the %d global batches of %s: evaluating %d",
                       validation.steps, available, source.name, available)
    return loader, min(validation.steps, available)
