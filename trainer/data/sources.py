"""Where documents come from: the bundled default, local files, or the Hugging Face hub."""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config.schema import DataLoader, Training
from trainer.errors import UserError, not_found

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

BUNDLED = "python_docs"
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    """One dataset as the config names it, and the config keys to name in errors."""

    dataset: str
    dataset_path: str = ""
    split: str = "train"
    section: str = "[training]"
    """Section holding ``dataset``/``dataset_path``, e.g. [training] or [validation]."""
    split_key: str = "[training.dataloader] split"

    @property
    def name(self) -> str:
        return self.dataset_path or self.dataset

    @property
    def path_key(self) -> str:
        return f"{self.section} dataset_path"


def training_source(training: Training) -> Source:
    return Source(training.dataset, training.dataset_path, training.dataloader.split)


def bundled_documents() -> list[str]:
    """Real English prose that ships with every Python: the interpreter's reference topics."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _local_files(path: Path, key: str) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise UserError(f"{key}: no {', '.join(_BUILDERS)} files in folder {path}")
    kinds = {_BUILDERS.get(f.suffix) for f in files}
    if None in kinds:
        raise UserError(f"{key}: {path} is not one of {', '.join(_BUILDERS)}")
    if len(kinds) > 1:
        raise UserError(f"{key}: folder {path} mixes file types {sorted(kinds)}; use one")
    return kinds.pop(), [str(f) for f in files]


def local_files(source: Source) -> list[Path]:
    """The raw files a local source reads (for the preparation cache key)."""
    return [Path(f) for f in _local_files(Path(source.dataset_path), source.path_key)[1]]


def _split_error(source: Source, e: Exception, what: str) -> UserError:
    first = str(e).strip().splitlines()[0]
    return UserError(f"{source.split_key}={source.split!r}: {what} are one split 'train' (slices like"
                     f" 'train[:90%]' work): {first[:200]}")


def load_documents(source: Source, opts: DataLoader) -> "datasets.Dataset | datasets.IterableDataset":
    """The documents of ``source``, read with ``[training.dataloader]`` options (``text_column``, ``subset``, ...)."""
    import datasets  # ~0.6 s: paid only when documents are read (a run on prepared or cached data never is)

    if source.dataset_path:
        path = Path(source.dataset_path)
        if not path.exists():
            raise not_found(source.path_key, path)
        builder, files = _local_files(path, source.path_key)
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            # Local files are one split named "train"; the split key may slice it
            # ("train[:90%]", "train[90%:]") to hold part of it out.
            ds = datasets.load_dataset(builder, data_files={"train": files}, split=source.split, **extra)
        except (ValueError, KeyError) as e:
            if "corresponds to no data" in str(e):  # an empty slice, like 'train[50%:50%]'
                raise UserError(f"{source.split_key}={source.split!r}: selects no documents of {source.name}") from None
            if "split" not in str(e).lower():
                raise UserError(f"{source.path_key}: cannot read {path} as {builder}: {e}") from None
            raise _split_error(source, e, "local files") from None
        except Exception as e:  # pyarrow/json parse errors carry the detail
            raise UserError(f"{source.path_key}: cannot read {path} as {builder}: {e}") from None
    elif source.dataset == BUNDLED:
        ds = datasets.Dataset.from_dict({opts.text_column: bundled_documents()})
        try:
            (part,) = datasets.ReadInstruction.from_spec(source.split).to_absolute({"train": len(ds)})
        except ValueError as e:
            raise _split_error(source, e, "the bundled documents") from None
        if (part.from_, part.to) != (0, len(ds)):
            ds = ds.select(range(part.from_, part.to))
    else:
        try:
            ds = datasets.load_dataset(source.dataset, opts.subset or None, split=source.split,
                                       streaming=opts.streaming)
        except Exception as e:  # offline, unknown name, unknown split: all surface here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"{source.section} dataset: cannot load {source.dataset!r} (split {source.split!r}): {first};"
                f" use '{BUNDLED}' or set {source.path_key} to local files"
            ) from None
    columns = ds.column_names
    if columns is not None and opts.text_column not in columns:
        raise UserError(
            f"[training.dataloader] text_column: {opts.text_column!r} is not a column of the dataset"
            f" (columns: {', '.join(columns)})"
        )
    return ds
