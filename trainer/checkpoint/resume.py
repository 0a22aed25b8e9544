"""Resume policy: which checkpoint a run continues from, and what it refuses or says when the checkpoint
and this run disagree (model tensors, global batch, tokenizer, attention). Every rank decides alike: each
reads the same folders and metadata."""

import dataclasses
import hashlib
import logging
import re
from pathlib import Path

import torch

from trainer.checkpoint.manifest import barrier, find_damage, rank
from trainer.checkpoint.torch_dcp import dcp
from trainer.config import schema
from trainer.errors import UserError

logger = logging.getLogger(__package__)

ATTENTION = ("causal", "block_causal")  # [model] attn_mask_type, saved as its index in train_state
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """A run's global batch: ``sequences`` per optimizer step, ``derived`` from the layout (global_batch_size = -1)
    or set, and ``how`` it is made up (for messages)."""

    sequences: int
    derived: bool
    how: str


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder`` (temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def is_full(path: Path) -> bool:
    """Whether the checkpoint at ``path`` can continue a run (it holds the step counter)."""
    try:
        keys = dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: the load reports it
        return True
    return any(key.startswith("train_state.") for key in keys)


def choose(cfg: schema.Checkpoint, folder: Path) -> tuple[Path, int] | None:
    """The checkpoint a run with ``[checkpoint]`` ``cfg`` continues from: ``load_step``, else the newest intact full
    one (damaged ones are set aside, or refused without ``fallback_on_damage``); None: nothing to resume."""
    steps = complete_steps(folder)
    if cfg.load_step != -1:
        if cfg.load_step not in steps:
            raise UserError(f"[checkpoint] load_step={cfg.load_step}: no complete checkpoint {folder}/step-"
                            f"{cfg.load_step} (available: {steps or 'none'})")
        path = folder / f"step-{cfg.load_step}"
        check_intact(path, "[checkpoint] load_step", cfg.verify)
        if not is_full(path):
            raise UserError(
                f"[checkpoint] load_step={cfg.load_step}: {path} holds model weights only and cannot continue a"
                " run; start from it with [checkpoint] initial_load_path in a new dump folder"
            )
        return path, cfg.load_step
    damaged = []
    for step in reversed(steps):
        path = folder / f"step-{step}"
        damage = find_damage(path) if cfg.verify else None
        if damage:
            if not cfg.fallback_on_damage:
                raise UserError(f"[checkpoint] {path} is damaged: {damage}; with fallback_on_damage = true the"
                                " previous complete checkpoint would be resumed instead")
            damaged.append(set_aside(path, damage))
            continue
        if is_full(path):
            return path, step
        # Written by an older version as the final weights-only save: not a run to continue.
        logger.warning("checkpoint %s holds model weights only; resuming from an earlier full checkpoint", path)
    if damaged:
        raise UserError(f"[checkpoint] every checkpoint in {folder} is damaged (kept as {', '.join(damaged)});"
                        " nothing to resume from. Remove them to start afresh")
    return None


def check_intact(path: Path, key: str, verify: bool) -> None:
    """For a checkpoint the user named: damage is an error, there is nothing to fall back to."""
    damage = find_damage(path) if verify and path.is_dir() else None
    if damage:
        raise UserError(f"{key}: {path} is damaged: {damage}")


def set_aside(path: Path, damage: str) -> str:
    """Move a damaged checkpoint out of the way (kept for inspection, never purged) and say so."""
    barrier()  # every rank names the folder before rank 0 renames it
    aside = path.with_name(f"{path.name}.damaged")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    if rank() == 0:
        path.rename(aside)
    barrier()
    logger.warning("checkpoint %s is damaged: %s; moved to %s, trying the previous checkpoint", path, damage,
                   aside.name)
    return aside.name


def check_model_tensors(path: Path, saved: set[str], model: set[str], exclude: list[str]) -> None:
    """The checkpoint's ``saved`` model tensors against the whole ``model``'s (every pipeline stage's, so every
    rank decides alike): tensors the model lacks would be dropped, which only an explicit
    ``exclude_from_loading = ["model.<name>"]`` allows. (Tensors the model has and the checkpoint lacks, or of
    another shape, fail in DCP's load.)"""
    left = [e[len("model."):] for e in exclude if e.startswith("model.")]
    for prefix in left:
        if any(k == prefix or k.startswith(prefix + ".") for k in model):
            raise UserError(f"[checkpoint] exclude_from_loading: 'model.{prefix}' names tensors this model has;"
                            " only tensors the model lacks can be left behind (exclude 'model' to load no weights)")
    for prefix in left:
        if not any(k == prefix or k.startswith(prefix + ".") for k in saved):
            logger.warning("[checkpoint] exclude_from_loading: 'model.%s' names no tensor of %s (a typo, or the"
                           " tensors are already gone); nothing is left behind for it", prefix, path)
    extra = sorted(saved - model)
    dropped = [k for k in extra if any(k == e or k.startswith(e + ".") for e in left)]
    refused = [k for k in extra if k not in dropped]
    if refused:
        raise UserError(
            f"[checkpoint] {path} holds {len(refused)} model tensors this model lacks ({_tensor_groups(refused)});"
            " loading would drop them. Resume with the model they were saved from, or leave them behind with"
            f" [checkpoint] exclude_from_loading = {['model.' + g.removesuffix('.*') for g in _groups(refused)]}"
        )
    if dropped:
        logger.warning("checkpoint %s: leaving behind %d model tensors this model lacks (%s), as [checkpoint]"
                       " exclude_from_loading asks", path, len(dropped), _tensor_groups(dropped))


def check_global_batch(batch: GlobalBatch | None, path: Path, saved: int, step: int) -> None:
    """The run continues with the global batch it was saved with, unless the user sets another one: a batch
    derived from the layout (global_batch_size = -1) that would change is refused."""
    if batch is None or saved == batch.sequences:
        return
    if batch.derived:
        raise UserError(
            f"[training] global_batch_size: {path} was trained with a global batch of {saved} sequences; this run's"
            f" would be {batch.sequences} ({batch.how}). Set [training] global_batch_size = {saved} to keep"
            f" it (gradient accumulation makes up the difference), or to {batch.sequences} to change it on purpose")
    logger.warning("the global batch changes from %d to %d sequences at step %d ([training] global_batch_size), as"
                   " configured; the optimisation continues with the new batch", saved, batch.sequences, step + 1)


def check_tokenizer(path: Path, saved: int, tokenizer: str) -> None:
    """Token ids mean the text of the tokenizer a checkpoint was trained with: another one is refused."""
    if saved != digest(tokenizer):
        raise UserError(f"[model] tokenizer_path: {path} was trained with another tokenizer than this run's"
                        f" ({tokenizer}): its token ids would mean other text. Resume with the tokenizer it"
                        " was trained with, or start a new run from its weights with [checkpoint]"
                        " initial_load_path")


def check_attention(attention: str, path: Path, train_state: dict) -> None:
    """A run continued with another [model] attn_mask_type than it was trained with says so (it continues as
    configured); checkpoints saved before the key existed were trained with causal attention."""
    saved = ATTENTION[int(train_state["attention"])] if "attention" in train_state else None
    if saved == attention or (saved is None and attention == "causal"):
        return
    before = f"with {saved} attention" if saved else "before [model] attn_mask_type existed, with causal attention"
    logger.warning("[model] attn_mask_type: %s was trained %s; this run continues with %s attention, as configured"
                   " (set attn_mask_type = %r to continue as it was trained)", path, before, attention,
                   saved or "causal")


DATA_BYTES = 256  # the saved description of the training data, padded or cut to this many bytes


def data_tensors(data: str) -> dict:
    """The train state's record of the training data: a digest (compared) and the description (said)."""
    raw = data.encode()[:DATA_BYTES].ljust(DATA_BYTES, b"\0")
    return {"data": torch.tensor(digest(data)), "data_text": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}


def check_data(data: str, path: Path, train_state: dict, resumed: int) -> None:
    """A run that continues from a checkpoint trained on other data says so in one line: the saved position is
    applied to this run's data (as the loader counts it), which is not where the old data were left."""
    if "data" not in train_state or int(train_state["data"]) == digest(data):
        return  # saved before the data were recorded, or the same data
    saved = bytes(train_state["data_text"].tolist()).rstrip(b"\0").decode(errors="replace") if (
        "data_text" in train_state) else "other data"
    logger.warning("[training] data: %s was trained on %s; this run reads %s: the saved data position (%d steps"
                   " read) continues in these data as if they were the same; add 'dataloader' to [checkpoint]"
                   " exclude_from_loading to read them from their start", path, saved, data, resumed)


def digest(text: str) -> int:
    """A 63-bit fingerprint of ``text``, storable as an int64 tensor."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _groups(keys: list[str]) -> list[str]:
    """Tensor names grouped by block (``layers.4.*``) where they sit in a numbered container."""
    out: list[str] = []
    for key in keys:
        parts = key.split(".")
        group = f"{parts[0]}.{parts[1]}.*" if len(parts) > 2 and parts[1].isdigit() else key
        if group not in out:
            out.append(group)
    return out


def _tensor_groups(keys: list[str], shown: int = 6) -> str:
    groups = _groups(keys)
    return ", ".join(groups[:shown]) + (f", ... ({len(groups) - shown} more)" if len(groups) > shown else "")
