"""Checkpoints with torch.distributed.checkpoint (DCP): save, atomic publish, resume on any layout.

A checkpoint is the folder ``<dump>/<[checkpoint] folder>/step-N``. It is written as
``step-N.tmp`` and renamed once complete, so a crash or kill during a save never leaves a
half-written ``step-N``; the previous one stays the latest loadable checkpoint. A weights-only
save (``last_save_model_only``) goes to ``model-step-N``, a name resuming never picks: only a
full checkpoint continues a run.

With ``[checkpoint] verify`` (the default) each folder also holds ``checksums.json``: the size
and sha256 of every file in it, hashed at save by the ranks in parallel (each a share of the
files) and checked the same way before loading. A checkpoint that fails the check is moved aside
to ``step-N.damaged`` (kept, never deleted) and the previous complete one is resumed instead,
with a warning; ``fallback_on_damage = false`` stops with an error instead. Checkpoints live on a
file system every rank sees, as DCP requires.

Everything is keyed by global parameter names (tied copies under their canonical name) and
the data position is global, so a checkpoint resumes under any parallel layout: DCP reshards
model and optimizer state to whatever this run's chunks and shards are.
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import schema
from trainer.config.schema import CHECKPOINT_PARTS
from trainer.dtensor import local_tensor
from trainer.dtypes import torch_dtype
from trainer.errors import UserError

logger = logging.getLogger(__name__)
# DCP says this on every save and load of a one-process run, which is expected here and tells the user nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

# The LR schedule is a function of the step counter in train_state, so it is not a part of its own.
PARTS = CHECKPOINT_PARTS
ATTENTION = ("causal", "block_causal")  # [model] attn_mask_type, saved as its index in train_state
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dcp():
    """torch.distributed.checkpoint with its state_dict helpers, imported at the first save or load: it
    imports DTensor and FSDP (~0.6 s), which a run that has not reached a checkpoint does not need."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict.*)

    return dcp


def _optim_options():
    return _dcp().state_dict.StateDictOptions(flatten_optimizer_state_dict=True)


MANIFEST = "checksums.json"
_PART = re.compile(r"^checksums\.rank\d+\.json$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_share(folder: Path) -> None:
    """Hash this rank's share of the files in ``folder`` into ``checksums.rank<R>.json`` (no collectives:
    safe in a background thread). Every rank lists the same folder, so the shares cover every file."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST and not _PART.match(p.name))
    mine = {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
            for name in names[_rank()::_world()]}
    (folder / f"checksums.rank{_rank()}.json").write_text(json.dumps(mine))


def merge_shares(folder: Path) -> None:
    """Rank 0, once every rank has hashed its share: one ``checksums.json`` for the folder. A file no
    share covers (a rank's listing lagging behind on a network file system) is hashed here."""
    files = {}
    for part in sorted(p for p in folder.iterdir() if _PART.match(p.name)):
        files.update(json.loads(part.read_text()))
        part.unlink()
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST and path.name not in files:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (folder / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1))


def find_damage(folder: Path) -> str | None:
    """What is wrong with ``folder`` by its ``checksums.json`` (None: intact, or saved without checksums).
    Every rank checks a share of the files; the verdicts are combined, so every rank returns the same."""
    names, expected, problem = [], [], 0  # problem: 0 none, 1 no manifest, 2 unreadable manifest
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        names = sorted(files)
        expected = [(int(files[n]["bytes"]), str(files[n]["sha256"])) for n in names]
    except FileNotFoundError:
        problem = 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        problem = 2
    # Every rank must take the same branch before the per-file verdicts are combined: agree on what
    # each read (the worst problem, and the number of files: the same manifest gives the same count).
    seen = torch.tensor([problem, len(names), -len(names)], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    problem, most, fewest = int(seen[0]), int(seen[1]), -int(seen[2])
    if problem == 1:
        if not (folder / ".metadata").is_file():  # no checksums and no metadata: nothing there to load
            return "its .metadata is missing (the folder was emptied, or the save never completed)"
        logger.warning("checkpoint %s has no %s (saved without [checkpoint] verify, or the file was lost):"
                       " loading it unverified", folder, MANIFEST)
        return None
    if problem == 2 or most != fewest:
        return f"its {MANIFEST} is unreadable" + ("" if problem == 2 else " (ranks read different contents)")
    # 0 = intact, 1 = missing, 2 = wrong size, 3 = wrong contents; combined with MAX over ranks (CPU: gloo)
    verdicts = torch.zeros(len(names), dtype=torch.int32)
    for i in range(_rank(), len(names), _world()):
        path = folder / names[i]
        if not path.is_file():
            verdicts[i] = 1
        elif path.stat().st_size != expected[i][0]:
            verdicts[i] = 2
        elif _sha256(path) != expected[i][1]:
            verdicts[i] = 3
    if dist.is_initialized():
        dist.all_reduce(verdicts, op=dist.ReduceOp.MAX)
    bad = [(names[i], int(v)) for i, v in enumerate(verdicts.tolist()) if v]
    if not bad:
        return None
    name, verdict = bad[0]
    size = expected[names.index(name)][0]
    what = {1: "is missing", 2: f"is not the {size} bytes written", 3: "has other contents than written"}
    more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
    return f"{name} {what[verdict]}{more}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in ``folder`` (temporary folders are ignored)."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def _is_full(path: Path) -> bool:
    """Whether the checkpoint at ``path`` can continue a run (it holds the step counter)."""
    try:
        keys = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: let _load report it
        return True
    return any(key.startswith("train_state.") for key in keys)


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


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a DCP save or load raises on failure: its CheckpointException (a BaseException, gathered from every
    rank) or an ordinary exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def first_failure(error: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (rank -> (exception, traceback)), else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


def _state_bytes(state) -> int:
    """Bytes of the tensors this rank holds in ``state`` (nested dicts; sharded tensors count their local part)."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        t = local_tensor(state)
        return t.numel() * t.element_size()
    return 0


def _digest(text: str) -> int:
    """A 63-bit fingerprint of ``text``, storable as an int64 tensor."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """A run's global batch: ``sequences`` per optimizer step, ``derived`` from the layout (global_batch_size = -1)
    or set, and ``how`` it is made up (for messages)."""

    sequences: int
    derived: bool
    how: str


class Checkpointer:
    """Saves and restores one rank's share of the training state."""

    def __init__(self, checkpoint: schema.Checkpoint, *, dump_folder: str, chunks, optimizers, loader, spec, model_args,
                 pp_rank: int = 0, pp: int = 1, hf_writer: bool = True, batch: "GlobalBatch | None" = None,
                 tokenizer=None, attention: str = ""):
        """``checkpoint`` is the ``[checkpoint]`` section. ``pp_rank``/``pp``/``hf_writer`` place this
        rank's file of a Hugging Face export (one writer per pipeline rank). ``batch`` is this run's global
        batch, saved with the step and compared on resume; ``tokenizer`` the tokenizer (its identity likewise; its files go
        into the Hugging Face export); ``attention`` the ``[model] attn_mask_type``, saved and compared on resume."""
        self.cfg = checkpoint
        self.folder = Path(dump_folder) / checkpoint.folder
        self.chunks, self.optimizers, self.loader = list(chunks), optimizers, loader
        self.spec, self.args = spec, model_args
        self.aliases = spec.tied_aliases(model_args)
        self.pp_rank, self.pp, self.hf_writer = pp_rank, pp, hf_writer
        self.batch = batch
        self.tokenizer = tokenizer.identity if tokenizer is not None else ""
        self.tokenizer_files = tokenizer
        self.attention = attention
        self.pending = None  # (future, name) of an asynchronous save in flight
        self._began: dict[str, float] = {}  # when each save in progress started (for the "saved" line)
        self._background = None  # the thread that finishes an asynchronous save: waits for DCP, then hashes

    # -- state --------------------------------------------------------------------------------
    def _canonical(self, key: str) -> str:
        """``output.weight`` -> ``tok_embeddings.weight`` for tied models, also inside optimizer keys
        such as ``state.output.weight.exp_avg``."""
        padded = f".{key}."
        for alias, canonical in self.aliases.items():
            padded = padded.replace(f".{alias}.", f".{canonical}.")
        return padded[1:-1]

    def _model_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for chunk in self.chunks:
            for key, value in _dcp().state_dict.get_model_state_dict(chunk).items():
                state[self._canonical(key)] = value
        return state

    def _optimizer_state(self) -> dict[str, object]:
        state = {}
        for chunk, opt in zip(self.chunks, self.optimizers.optimizers):
            for key, value in _dcp().state_dict.get_optimizer_state_dict(chunk, opt, options=_optim_options()).items():
                state[self._canonical(key)] = value
        return state

    def _state(self, step: int, model_only: bool = False) -> dict[str, object]:
        state: dict[str, object] = {"model": self._model_state()}
        if model_only:
            return state
        position = self.loader.state_dict()
        state["optimizer"] = self._optimizer_state()
        state["dataloader"] = {k: torch.tensor(v) for k, v in position.items()}
        state["train_state"] = {"step": torch.tensor(step)}
        if self.batch is not None:
            state["train_state"]["global_batch"] = torch.tensor(self.batch.sequences)
        if self.tokenizer:
            state["train_state"]["tokenizer"] = torch.tensor(_digest(self.tokenizer))
        if self.attention:
            state["train_state"]["attention"] = torch.tensor(ATTENTION.index(self.attention))
        state["rng"] = self._rng_state()
        return state

    @staticmethod
    def _rng_state() -> dict[str, torch.Tensor]:
        """This rank's generator states, under a per-rank key (ranks' generators differ)."""
        state = {f"rank{_rank()}.cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state[f"rank{_rank()}.cuda"] = torch.cuda.get_rng_state()
        return state

    # -- save ---------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, last: bool, final: bool) -> None:
        """Save at every ``interval`` and at this run's ``last`` step. At the ``final`` step of
        training, ``last_save_model_only`` also writes the weights alone, and ``export_hf`` exports them."""
        if final and self.cfg.export_hf:
            self.export_hf(step)
        if not self.cfg.enable or not (last or step % self.cfg.interval == 0):
            return
        self.wait()  # at most one save in flight: the next waits for the previous
        # The full state is saved at the end too, so that raising [training] steps continues the run.
        self._save(self._state(step), f"step-{step}", background=self.cfg.async_mode == "async" and not last)
        if final and self.cfg.last_save_model_only:
            dtype = torch_dtype(self.cfg.export_dtype)
            self._save({"model": {k: v.to(dtype) for k, v in self._model_state().items()}}, f"model-step-{step}",
                       background=False)

    def export_hf(self, step: int) -> None:
        """Write the Hugging Face export of this step (every rank calls it: it gathers sharded weights)."""
        from trainer.hf import export_hf

        export_hf(self.chunks, self.spec, self.args, self.folder / f"hf-step-{step}", torch_dtype(self.cfg.export_dtype),
                  pp_rank=self.pp_rank, pp=self.pp, writer=self.hf_writer, tokenizer=self.tokenizer_files)

    def export_finished(self, step: int) -> None:
        """A finished run started again with ``export_hf`` and no export of its last step yet: export it now."""
        if self.cfg.export_hf and not (self.folder / f"hf-step-{step}" / "config.json").is_file():
            logger.info("the run finished at step %d before; exporting its weights ([checkpoint] export_hf)", step)
            self.export_hf(step)

    def _save(self, state: dict, name: str, *, background: bool) -> None:
        tmp, final = self.folder / f"{name}.tmp", self.folder / name
        # Something not ours where the checkpoint goes: stop before writing, on every rank alike (they see
        # the same folder), rather than fail in the rename on rank 0 alone or delete the user's file.
        for path in (final, tmp):
            if path.exists() and not path.is_dir():
                raise UserError(f"[checkpoint] folder: {path} is a file, where checkpoint {name} is to be saved;"
                                f" move it away and resume (the checkpoints saved so far are kept)")
        self._began[name] = time.monotonic()
        logger.info("checkpoint %s: saving %.2f GiB (this rank's share)%s", name, _state_bytes(state) / 2**30,
                    " in the background" if background else "")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        try:  # every rank: a read-only or full disk fails alike everywhere, not on rank 0 alone
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._save_failed(name, e) from None
        _barrier()
        if background:
            try:
                saving = _dcp().async_save(state, checkpoint_id=str(tmp))
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None
            if self._background is None:
                self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            self.pending = (self._background.submit(self._finish_files, saving, tmp), name)
        else:
            try:
                _dcp().save(state, checkpoint_id=str(tmp))
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None
            _barrier()  # every rank's files are on disk before any rank lists the folder
            if self.cfg.verify:
                hash_share(tmp)
            self._publish(name)

    def _finish_files(self, saving, tmp: Path) -> None:
        """Background part of an asynchronous save: DCP's write (which ends with every rank's files and
        the metadata written), then this rank's share of the checksums."""
        saving.result()
        if self.cfg.verify:
            hash_share(tmp)

    def wait(self) -> None:
        """Finish an asynchronous save, if one is in flight."""
        if self.pending is not None:
            future, name = self.pending
            self.pending = None
            try:
                future.result()
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None
            self._publish(name)

    def _save_failed(self, name: str, error: BaseException) -> UserError:
        """A save that could not be written (full or read-only disk, ...): its partial folder is removed, the
        checkpoints before it are untouched, and the error names the folder and the cause."""
        if _rank() == 0:
            shutil.rmtree(self.folder / f"{name}.tmp", ignore_errors=True)
        error = first_failure(error)
        cause = (error.strerror + (f" ({error.filename})" if error.filename else "")
                 if isinstance(error, OSError) and error.strerror
                 else f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        return UserError(f"[checkpoint] folder: could not save {name} into {self.folder}: {cause}; the partial save"
                         f" was removed and the checkpoints saved before it are kept")

    def _publish(self, name: str) -> None:
        _barrier()  # every rank's files (and checksum share) are written before the folder is published
        if _rank() == 0:
            if self.cfg.verify:
                merge_shares(self.folder / f"{name}.tmp")
            final = self.folder / name
            shutil.rmtree(final, ignore_errors=True)
            (self.folder / f"{name}.tmp").rename(final)
            seconds = time.monotonic() - self._began.pop(name, time.monotonic())
            logger.info("checkpoint saved: %s (%.1f s)", final, seconds)
            self._purge()
        _barrier()

    def _purge(self) -> None:
        keep = self.cfg.keep_latest_k
        if keep > 0:
            for old in complete_steps(self.folder)[:-keep]:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    # -- load ---------------------------------------------------------------------------------
    def load(self) -> int:
        """Restore the newest complete checkpoint (or ``load_step``); returns the step it ends, 0 = fresh."""
        steps = complete_steps(self.folder) if self.cfg.enable else []
        if self.cfg.enable and self.cfg.load_step != -1:
            if self.cfg.load_step not in steps:
                raise UserError(
                    f"[checkpoint] load_step={self.cfg.load_step}: no complete checkpoint {self.folder}/step-"
                    f"{self.cfg.load_step} (available: {steps or 'none'})"
                )
            path = self.folder / f"step-{self.cfg.load_step}"
            self._check_intact(path, "[checkpoint] load_step")
            if not _is_full(path):
                raise UserError(
                    f"[checkpoint] load_step={self.cfg.load_step}: {path} holds model weights only and cannot continue a"
                    " run; start from it with [checkpoint] initial_load_path in a new dump folder"
                )
            return self._load(path, self.cfg.load_step)
        damaged = []
        for step in reversed(steps):
            path = self.folder / f"step-{step}"
            damage = find_damage(path) if self.cfg.verify else None
            if damage:
                if not self.cfg.fallback_on_damage:
                    raise UserError(f"[checkpoint] {path} is damaged: {damage}; with fallback_on_damage = true the"
                                    " previous complete checkpoint would be resumed instead")
                damaged.append(self._set_aside(path, damage))
                continue
            if _is_full(path):
                return self._load(path, step)
            # Written by an older version as the final weights-only save: not a run to continue.
            logger.warning("checkpoint %s holds model weights only; resuming from an earlier full checkpoint", path)
        if damaged:
            raise UserError(f"[checkpoint] every checkpoint in {self.folder} is damaged (kept as {', '.join(damaged)});"
                            " nothing to resume from. Remove them to start afresh")
        if self.cfg.initial_load_path:
            from trainer.hf import is_hf_folder, load_hf_

            path = Path(self.cfg.initial_load_path)
            if is_hf_folder(path):
                load_hf_(self.chunks, self.spec, self.args, path)
            else:
                self._check_intact(path, "[checkpoint] initial_load_path")
                self._load(path, None)
        return 0

    def _check_intact(self, path: Path, key: str) -> None:
        """For a checkpoint the user named: damage is an error, there is nothing to fall back to."""
        damage = find_damage(path) if self.cfg.verify and path.is_dir() else None
        if damage:
            raise UserError(f"{key}: {path} is damaged: {damage}")

    def _set_aside(self, path: Path, damage: str) -> str:
        """Move a damaged checkpoint out of the way (kept for inspection, never purged) and say so."""
        _barrier()  # every rank names the folder before rank 0 renames it
        aside = path.with_name(f"{path.name}.damaged")
        n = 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
        if _rank() == 0:
            path.rename(aside)
        _barrier()
        logger.warning("checkpoint %s is damaged: %s; moved to %s, trying the previous checkpoint", path, damage,
                       aside.name)
        return aside.name

    def _check_model_tensors(self, path: Path, saved: set[str]) -> None:
        """The checkpoint's model tensors against the whole model's (every pipeline stage's, so every rank
        decides alike): tensors the model lacks would be dropped, which only an explicit
        ``exclude_from_loading = ["model.<name>"]`` allows. (Tensors the model has and the checkpoint
        lacks, or of another shape, fail in DCP's load.)"""
        model = {self._canonical(k) for k in self.spec.meta_model(self.args).state_dict()}
        left = [e[len("model."):] for e in self.cfg.exclude_from_loading if e.startswith("model.")]
        for prefix in left:
            if any(k == prefix or k.startswith(prefix + ".") for k in model):
                raise UserError(f"[checkpoint] exclude_from_loading: 'model.{prefix}' names tensors this model has;"
                                " only tensors the model lacks can be left behind (exclude 'model' to load no weights)")
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

    def _check_global_batch(self, path: Path, saved: int, step: int) -> None:
        """The run continues with the global batch it was saved with, unless the user sets another one: a batch
        derived from the layout (global_batch_size = -1) that would change is refused."""
        if self.batch is None or saved == self.batch.sequences:
            return
        if self.batch.derived:
            raise UserError(
                f"[training] global_batch_size: {path} was trained with a global batch of {saved} sequences; this run's"
                f" would be {self.batch.sequences} ({self.batch.how}). Set [training] global_batch_size = {saved} to keep"
                f" it (gradient accumulation makes up the difference), or to {self.batch.sequences} to change it on purpose")
        logger.warning("the global batch changes from %d to %d sequences at step %d ([training] global_batch_size), as"
                       " configured; the optimisation continues with the new batch", saved, self.batch.sequences, step + 1)

    def _check_attention(self, path: Path, train_state: dict) -> None:
        """A run continued with another [model] attn_mask_type than it was trained with says so (it continues as
        configured); checkpoints saved before the key existed were trained with causal attention."""
        saved = ATTENTION[int(train_state["attention"])] if "attention" in train_state else None
        if saved == self.attention or (saved is None and self.attention == "causal"):
            return
        before = f"with {saved} attention" if saved else "before [model] attn_mask_type existed, with causal attention"
        logger.warning("[model] attn_mask_type: %s was trained %s; this run continues with %s attention, as configured"
                       " (set attn_mask_type = %r to continue as it was trained)", path, before, self.attention,
                       saved or "causal")

    def _load(self, path: Path, step: int | None) -> int:
        began = time.monotonic()
        logger.info("loading checkpoint %s", path)
        if step is not None and self.cfg.initial_load_path:
            logger.warning("[checkpoint] initial_load_path %s is not used: the run resumes its own checkpoint %s"
                           " (initial_load_path only starts a run that has no checkpoint yet)",
                           self.cfg.initial_load_path, path)
        try:
            saved = set(_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        except Exception as e:  # missing or unreadable .metadata
            raise UserError(f"[checkpoint] {path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
        parts_in_file = {key.split(".")[0] for key in saved}
        wanted = [p for p in PARTS if p not in self.cfg.exclude_from_loading]
        if step is None:  # initial_load_path: weights to start from, not a run to continue
            wanted = ["model"]
        missing = [p for p in wanted if p not in parts_in_file]
        if "model" in missing:
            raise UserError(f"[checkpoint] {path} holds no model weights")
        if missing:
            logger.warning("checkpoint %s has no %s (model-only save); starting those fresh", path, ", ".join(missing))
        if "model" in wanted:
            self._check_model_tensors(path, {k[len("model."):] for k in saved if k.startswith("model.")})
        wanted = [p for p in wanted if p in parts_in_file]
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved_ranks = {int(m.group(1)) for k in saved if (m := re.fullmatch(r"rng\.rank(\d+)\.cpu", k))}
        if "rng" in wanted and saved_ranks != set(range(world)):
            # Saved by another number of ranks: generator states do not map one to one. Every
            # rank sees the same metadata, so every rank makes the same choice.
            logger.warning("checkpoint %s holds the random generator states of %d ranks and this run has %d; random"
                           " generators start fresh", path, len(saved_ranks), world)
            wanted.remove("rng")
        if "optimizer" in wanted:
            self.optimizers.init_state()  # Adam's state exists only after a step; DCP loads into it
        full = self._state(step or 0)
        state = {k: v for k, v in full.items() if k in wanted}
        if "train_state" in state:  # what this checkpoint's train state holds (older saves lack the batch)
            state["train_state"] = {k: v for k, v in state["train_state"].items() if f"train_state.{k}" in saved}
        if "dataloader" in state:  # every saved key: a stream's lanes were saved by the ranks that own them
            state["dataloader"] = {k.split(".", 1)[1]: torch.tensor(0) for k in saved if k.startswith("dataloader.")}
        dcp = _dcp()
        try:
            dcp.load(state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=False))
        except dcp_errors() as e:
            cause = first_failure(e)
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise UserError(
                f"[checkpoint] cannot load {path} into this model ({first[:300]}); was it saved from another"
                " model shape?"
            ) from None
        if "model" in state:
            for chunk in self.chunks:
                keys = dcp.state_dict.get_model_state_dict(chunk).keys()
                dcp.state_dict.set_model_state_dict(chunk, {k: state["model"][self._canonical(k)] for k in keys})
        else:
            logger.warning("checkpoint %s: model weights not loaded ([checkpoint] exclude_from_loading); the run"
                           " continues from freshly initialised weights", path)
        if "optimizer" in state:
            for chunk, opt in zip(self.chunks, self.optimizers.optimizers):
                keys = dcp.state_dict.get_optimizer_state_dict(chunk, opt, options=_optim_options()).keys()
                chunk_state = {k: state["optimizer"][self._canonical(k)] for k in keys}
                dcp.state_dict.set_optimizer_state_dict(chunk, opt, chunk_state, options=_optim_options())
        resumed = int(state["train_state"]["step"]) if "train_state" in state else 0
        if "global_batch" in state.get("train_state", {}):
            self._check_global_batch(path, int(state["train_state"]["global_batch"]), resumed)
        if "tokenizer" in state.get("train_state", {}) and "model" in wanted and self.tokenizer:
            if int(state["train_state"]["tokenizer"]) != _digest(self.tokenizer):
                raise UserError(f"[model] tokenizer_path: {path} was trained with another tokenizer than this run's"
                                f" ({self.tokenizer}): its token ids would mean other text. Resume with the tokenizer it"
                                " was trained with, or start a new run from its weights with [checkpoint]"
                                " initial_load_path")
        if step is not None and self.attention and "train_state" in state:
            self._check_attention(path, state["train_state"])
        # The LR schedule continues from the step the run continues from (0 when train_state is
        # excluded: both restart), so the schedule and the step counter always agree.
        self.optimizers.set_schedule_position(resumed)
        if "dataloader" in state:
            self.loader.load_state_dict({k: int(v) for k, v in state["dataloader"].items()})
        if "rng" in state:
            for key, value in state["rng"].items():
                (torch.set_rng_state if key.endswith(".cpu") else torch.cuda.set_rng_state)(value)
        logger.info("resumed from %s (%s) in %.1f s", path, ", ".join(wanted), time.monotonic() - began)
        return resumed
