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

Modules: ``checkpointer`` (state, save and publish, load, the export trigger), ``resume`` (which checkpoint a
run continues from and what it checks), ``manifest`` (checksums), ``torch_dcp`` (the seams to DCP).
"""

from trainer.checkpoint.checkpointer import PARTS, Checkpointer, build_save_group
from trainer.checkpoint.manifest import MANIFEST, find_damage, hash_share, merge_shares
from trainer.checkpoint.resume import GlobalBatch, complete_steps
from trainer.checkpoint.torch_dcp import dcp_errors, first_failure

__all__ = ["MANIFEST", "PARTS", "Checkpointer", "GlobalBatch", "build_save_group", "complete_steps", "dcp_errors",
           "find_damage", "first_failure", "hash_share", "merge_shares"]
