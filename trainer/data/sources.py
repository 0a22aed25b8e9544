"""Where documents come from: the bundled default, local files, or the Hugging Face hub."""

import logging
from pathlib import Path

import datasets

from trainer.config.schema import Training
from trainer.errors import UserError

logger = logging.getLogger(__name__)

BUNDLED = "python_docs"
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def bundled_documents() -> list[str]:
    """Real English prose that ships with every Python: the interpreter's reference topics."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise UserError(f"[training] dataset_path: no {', '.join(_BUILDERS)} files in folder {path}")
    kinds = {_BUILDERS.get(f.suffix) for f in files}
    if None in kinds:
        raise UserError(f"[training] dataset_path: {path} is not one of {', '.join(_BUILDERS)}")
    if len(kinds) > 1:
        raise UserError(f"[training] dataset_path: folder {path} mixes file types {sorted(kinds)}; use one")
    return kinds.pop(), [str(f) for f in files]


def load_documents(training: Training) -> datasets.Dataset | datasets.IterableDataset:
    """The document dataset named by ``[training]`` (``dataset``, ``dataset_path``, ``dataloader``)."""
    opts = training.dataloader
    if training.dataset_path:
        path = Path(training.dataset_path)
        if not path.exists():
            raise UserError(f"[training] dataset_path: file not found: {path}")
        builder, files = _local_files(path)
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            # Local files are one split named "train"; [training.dataloader] split may slice it
            # ("train[:90%]", "train[90%:]") to hold part of it out.
            ds = datasets.load_dataset(builder, data_files={"train": files}, split=opts.split, **extra)
        except (ValueError, KeyError) as e:
            if "split" not in str(e).lower():
                raise UserError(f"[training] dataset_path: cannot read {path} as {builder}: {e}") from None
            first = str(e).strip().splitlines()[0]
            raise UserError(
                f"[training.dataloader] split={opts.split!r}: local files are one split 'train' (slices like"
                f" 'train[:90%]' work): {first[:200]}"
            ) from None
        except Exception as e:  # pyarrow/json parse errors carry the detail
            raise UserError(f"[training] dataset_path: cannot read {path} as {builder}: {e}") from None
    elif training.dataset == BUNDLED:
        ds = datasets.Dataset.from_dict({opts.text_column: bundled_documents()})
    else:
        try:
            ds = datasets.load_dataset(
                training.dataset, opts.subset or None, split=opts.split, streaming=opts.streaming
            )
        except Exception as e:  # offline, unknown name, unknown split: all surface here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"[training] dataset: cannot load {training.dataset!r} (split {opts.split!r}): {first};"
                f" use '{BUNDLED}' or set [training] dataset_path to local files"
            ) from None
    columns = ds.column_names
    if columns is not None and opts.text_column not in columns:
        raise UserError(
            f"[training.dataloader] text_column: {opts.text_column!r} is not a column of the dataset"
            f" (columns: {', '.join(columns)})"
        )
    return ds
