"""The Checkpointer: one rank's share of the training state, saved with DCP into a temporary folder and
published by a rename (see the package docstring), restored under any layout, and the Hugging Face export
triggered at the end of training."""

import concurrent.futures
import datetime
import logging
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.manifest import barrier, hash_share, merge_shares, rank
from trainer.checkpoint.resume import (ATTENTION, GlobalBatch, check_attention, check_data, check_global_batch,
                                       check_intact, check_model_tensors, check_tokenizer, choose, complete_steps,
                                       data_tensors, digest)
from trainer.checkpoint.torch_dcp import (dcp, dcp_errors, first_failure, optim_options, pinned_stager,
                                         stager_keeps_buffers)
from trainer.config import schema
from trainer.config.schema import CHECKPOINT_PARTS
from trainer.dtensor import local_tensor
from trainer.dtypes import torch_dtype
from trainer.errors import UserError, lost_peer

logger = logging.getLogger(__package__)

# The LR schedule is a function of the step counter in train_state, so it is not a part of its own.
PARTS = CHECKPOINT_PARTS


def build_save_group(checkpoint: schema.Checkpoint, timeout_seconds: int):
    """The process group of this job's asynchronous saves, or None (one process, or saves in the foreground).

    DCP's asynchronous save runs its collectives (planning, the metadata's gather) in a background thread while
    training goes on. On the training step's groups the two would interleave: gloo aborts on a collective mismatch
    or both sides wait (issue 66), and NCCL would be the same defect. A gloo group of its own (DCP needs a CPU
    backend there, also on GPUs) keeps them apart. Every rank creates it at start, in the same order; it starts with
    the set-up timeout and takes the train timeout with every other group after the first step."""
    if not dist.is_initialized() or not checkpoint.enable or checkpoint.async_mode == "disabled":
        return None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
    logger.info("checkpoint: saves in the background ([checkpoint] async_mode = %r) run their collectives on a gloo"
                " process group of their own (%d ranks), apart from the training step's", checkpoint.async_mode,
                dist.get_world_size())
    return group


def _state_bytes(state) -> int:
    """Bytes of the tensors this rank holds in ``state`` (nested dicts; sharded tensors count their local part)."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        t = local_tensor(state)
        return t.numel() * t.element_size()
    return 0


class Checkpointer:
    """Saves and restores one rank's share of the training state."""

    def __init__(self, checkpoint: schema.Checkpoint, *, dump_folder: str, chunks, optimizers, loader, spec, model_args,
                 pp_rank: int = 0, pp: int = 1, hf_writer: bool = True, batch: "GlobalBatch | None" = None,
                 tokenizer=None, attention: str = "", save_group=None, model_context: int | None = None,
                 data: str = ""):
        """``checkpoint`` is the ``[checkpoint]`` section. ``pp_rank``/``pp``/``hf_writer`` place this
        rank's file of a Hugging Face export (one writer per pipeline rank). ``batch`` is this run's global
        batch, saved with the step and compared on resume; ``tokenizer`` the tokenizer (its identity likewise; its
        files go into the Hugging Face export); ``attention`` the ``[model] attn_mask_type``, saved and compared
        on resume. ``save_group`` is the process group of asynchronous saves (``build_save_group``; None in one
        process). ``model_context``: the model's own context, kept in the export's config.json
        (``trainer.hf.model_context``). ``data``: what the training data are (``data_identity``), saved and
        compared on resume."""
        self.cfg = checkpoint
        self.folder = Path(dump_folder) / checkpoint.folder
        self.chunks, self.optimizers, self.loader = list(chunks), optimizers, loader
        self.spec, self.args, self.model_context = spec, model_args, model_context
        self.aliases = spec.tied_aliases(model_args)
        self.pp_rank, self.pp, self.hf_writer = pp_rank, pp, hf_writer
        self.batch, self.data = batch, data
        self.tokenizer = tokenizer.identity if tokenizer is not None else ""
        self.tokenizer_files = tokenizer
        self.attention = attention
        self.save_group = save_group
        self.pending = None  # (future, name) of an asynchronous save in flight
        self._began: dict[str, float] = {}  # when each save in progress started (for the "saved" line)
        self._background = None  # the thread that finishes an asynchronous save: waits for DCP, then hashes
        self._stager = None  # async_with_pinned_mem: DCP's stager, whose pinned host buffers later saves reuse
        pinned_asked = checkpoint.async_mode == "async_with_pinned_mem"
        self.pinned = pinned_asked and torch.cuda.is_available()
        if pinned_asked and not self.pinned and checkpoint.enable:
            logger.warning("[checkpoint] async_mode = 'async_with_pinned_mem' needs CUDA; saving in the background"
                           " from ordinary host memory (as 'async')")

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
            for key, value in dcp().state_dict.get_model_state_dict(chunk).items():
                state[self._canonical(key)] = value
        return state

    def _optimizer_state(self) -> dict[str, object]:
        state = {}
        for chunk, opt in zip(self.chunks, self.optimizers.optimizers):
            for key, value in dcp().state_dict.get_optimizer_state_dict(chunk, opt, options=optim_options()).items():
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
            state["train_state"]["tokenizer"] = torch.tensor(digest(self.tokenizer))
        if self.data:
            state["train_state"].update(data_tensors(self.data))
        if self.attention:
            state["train_state"]["attention"] = torch.tensor(ATTENTION.index(self.attention))
        state["rng"] = self._rng_state()
        return state

    @staticmethod
    def _rng_state() -> dict[str, torch.Tensor]:
        """This rank's generator states, under a per-rank key (ranks' generators differ)."""
        state = {f"rank{rank()}.cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state[f"rank{rank()}.cuda"] = torch.cuda.get_rng_state()
        return state

    # -- save ---------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, last: bool, final: bool) -> None:
        """Save at every ``interval`` and at this run's ``last`` step. At the ``final`` step of
        training, ``last_save_model_only`` also writes the weights alone, and ``export_hf`` exports them."""
        if self.cfg.enable and (last or step % self.cfg.interval == 0):
            self.wait()  # at most one save in flight: the next waits for the previous
            # The full state is saved at the end too, so that raising [training] steps continues the run.
            self._save(self._state(step), f"step-{step}", background=self.cfg.async_mode != "disabled" and not last)
            if final and self.cfg.last_save_model_only:
                dtype = torch_dtype(self.cfg.export_dtype)
                # the router's choosing bias stays float32 (in bf16 it can change which experts are chosen)
                self._save({"model": {k: v if k.endswith("router.expert_bias") else v.to(dtype)
                                      for k, v in self._model_state().items()}}, f"model-step-{step}", background=False)
        if final and self.cfg.export_hf:  # after the save: an export that fails keeps the last checkpoint
            self.export_hf(step)

    def export_hf(self, step: int) -> None:
        """Write the Hugging Face export of this step (every rank calls it: it gathers sharded weights)."""
        from trainer.hf import export_hf

        export_hf(self.chunks, self.spec, self.args, self.folder / f"hf-step-{step}",
                  torch_dtype(self.cfg.export_dtype),
                  pp_rank=self.pp_rank, pp=self.pp, writer=self.hf_writer, tokenizer=self.tokenizer_files,
                  context=self.model_context)

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
        how = "" if not background else " in the background" + (" through pinned host buffers" if self.pinned else "")
        logger.info("checkpoint %s: saving %.2f GiB (this rank's share)%s", name, _state_bytes(state) / 2**30, how)
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        try:  # every rank: a read-only or full disk fails alike everywhere, not on rank 0 alone
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._save_failed(name, e) from None
        barrier()
        if background:
            try:
                if self.pinned and (self._stager is None or not stager_keeps_buffers()):
                    self._stager = pinned_stager()
                saving = dcp().async_save(state, checkpoint_id=str(tmp), async_stager=self._stager,
                                          process_group=self.save_group)
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None
            if self._background is None:
                self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            self.pending = (self._background.submit(self._finish_files, saving, name), name)
        else:
            try:
                dcp().save(state, checkpoint_id=str(tmp))
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None
            barrier()  # every rank's files are on disk before any rank lists the folder
            if self.cfg.verify:
                hash_share(tmp)
            self._publish(name)

    def _finish_files(self, saving, name: str) -> None:
        """Background part of an asynchronous save: DCP's write (which ends with every rank's files and the metadata
        written), this rank's share of the checksums, then the publication, so that a finished save is a checkpoint
        at once and not only when the next save or the end of training waits for it. Its collectives are on the save
        group, apart from the training step's."""
        saving.result()
        if self.cfg.verify:
            hash_share(self.folder / f"{name}.tmp")
        self._publish(name, self.save_group)

    def wait(self) -> None:
        """Finish an asynchronous save, if one is in flight."""
        if self.pending is not None:
            future, name = self.pending
            self.pending = None
            try:
                future.result()
            except dcp_errors() as e:
                raise self._save_failed(name, e) from None

    def abandon(self) -> None:
        """The run stops (an error) while a save is in the background: this rank waits for the save to end (its
        collectives end it at the latest at the save group's timeout), so that the process groups are not destroyed
        under its thread. A save that could not finish is never published: its ``step-N.tmp`` stays (a resume
        ignores it and the next save of that step replaces it) and the newest checkpoint is the one before it."""
        if self.pending is None:
            return
        future, name = self.pending
        self.pending = None
        concurrent.futures.wait([future])
        if future.exception() is not None:
            newest = complete_steps(self.folder)
            logger.warning("checkpoint %s: not published (the run stopped while it was saved in the background); the"
                           " newest checkpoint is %s", name, f"step-{newest[-1]}" if newest else "none")

    def _save_failed(self, name: str, error: BaseException) -> BaseException:
        """A save that could not be written (full or read-only disk, ...): its partial folder is removed, the
        checkpoints before it are untouched, and the error names the folder and the cause. A save that failed
        because another rank died or stopped answering gives that error instead, which the entry point reports
        as lost contact."""
        error = first_failure(error)
        if lost_peer(error):
            return error
        if rank() == 0:
            shutil.rmtree(self.folder / f"{name}.tmp", ignore_errors=True)
        cause = (error.strerror + (f" ({error.filename})" if error.filename else "")
                 if isinstance(error, OSError) and error.strerror
                 else f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        return UserError(f"[checkpoint] folder: could not save {name} into {self.folder}: {cause}; the partial save"
                         f" was removed and the checkpoints saved before it are kept")

    def _publish(self, name: str, group=None) -> None:
        """Rename ``name.tmp`` to ``name`` (rank 0), once every rank of ``group`` (default: the job) has written."""
        barrier(group)  # every rank's files (and checksum share) are written before the folder is published
        if rank() == 0:
            if self.cfg.verify:
                merge_shares(self.folder / f"{name}.tmp")
            final = self.folder / name
            shutil.rmtree(final, ignore_errors=True)
            (self.folder / f"{name}.tmp").rename(final)
            seconds = time.monotonic() - self._began.pop(name, time.monotonic())
            logger.info("checkpoint saved: %s (%.1f s)", final, seconds)
            self._purge()
        barrier(group)

    def _purge(self) -> None:
        keep = self.cfg.keep_latest_k
        if keep > 0:
            for old in complete_steps(self.folder)[:-keep]:
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

    # -- load ---------------------------------------------------------------------------------
    def load(self) -> int:
        """Restore the newest complete checkpoint (or ``load_step``); returns the step it ends, 0 = fresh."""
        chosen = choose(self.cfg, self.folder) if self.cfg.enable else None
        if chosen is not None:
            return self._load(*chosen)
        if self.cfg.initial_load_path:
            from trainer.hf import is_hf_folder, load_hf_

            path = Path(self.cfg.initial_load_path)
            if is_hf_folder(path):
                load_hf_(self.chunks, self.spec, self.args, path)
            else:
                check_intact(path, "[checkpoint] initial_load_path", self.cfg.verify)
                self._load(path, None)
        return 0

    def _load(self, path: Path, step: int | None) -> int:
        began = time.monotonic()
        logger.info("loading checkpoint %s", path)
        if step is not None and self.cfg.initial_load_path:
            logger.warning("[checkpoint] initial_load_path %s is not used: the run resumes its own checkpoint %s"
                           " (initial_load_path only starts a run that has no checkpoint yet)",
                           self.cfg.initial_load_path, path)
        try:
            saved = set(dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)
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
            model = {self._canonical(k) for k in self.spec.meta_model(self.args).state_dict()}
            check_model_tensors(path, {k[len("model."):] for k in saved if k.startswith("model.")}, model,
                                self.cfg.exclude_from_loading)
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
        api = dcp()
        try:
            api.load(state, checkpoint_id=str(path), planner=api.DefaultLoadPlanner(allow_partial_load=False))
        except dcp_errors() as e:
            cause = first_failure(e)
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise UserError(
                f"[checkpoint] cannot load {path} into this model ({first[:300]}); was it saved from another"
                " model shape?"
            ) from None
        if "model" in state:
            for chunk in self.chunks:
                keys = api.state_dict.get_model_state_dict(chunk).keys()
                api.state_dict.set_model_state_dict(chunk, {k: state["model"][self._canonical(k)] for k in keys})
        else:
            logger.warning("checkpoint %s: model weights not loaded ([checkpoint] exclude_from_loading); the run"
                           " continues from freshly initialised weights", path)
        if "optimizer" in state:
            for chunk, opt in zip(self.chunks, self.optimizers.optimizers):
                keys = api.state_dict.get_optimizer_state_dict(chunk, opt, options=optim_options()).keys()
                chunk_state = {k: state["optimizer"][self._canonical(k)] for k in keys}
                api.state_dict.set_optimizer_state_dict(chunk, opt, chunk_state, options=optim_options())
        resumed = int(state["train_state"]["step"]) if "train_state" in state else 0
        if "global_batch" in state.get("train_state", {}):
            check_global_batch(self.batch, path, int(state["train_state"]["global_batch"]), resumed)
        if "tokenizer" in state.get("train_state", {}) and "model" in wanted and self.tokenizer:
            check_tokenizer(path, int(state["train_state"]["tokenizer"]), self.tokenizer)
        if step is not None and self.attention and "train_state" in state:
            check_attention(self.attention, path, state["train_state"])
        if self.data and "dataloader" in state and "train_state" in state:
            check_data(self.data, path, state["train_state"], resumed)
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
