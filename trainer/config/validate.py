"""Checks that need nothing but the config: run when it is loaded, before anything is built.

Checks that need the model, the world size or torch (parallel degrees, split points, TP plans,
schedule constraints) happen while the job plan is built (``trainer.plan.build_job_plan``).
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config.schedules import CSV_KEY, SCHEDULES
from trainer.config.schema import CHECKPOINT_PARTS, MAX_COUNT, JobConfig, LRScheduler, Training
from trainer.errors import ConfigError, not_found

logger = logging.getLogger(__name__)
_FILE_KEYS = ("[model] tokenizer_path", "[parallelism] pipeline_parallel_schedule_csv")
_RAW_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")  # the local file types trainer.data.sources reads


def validate_config(config: JobConfig) -> None:
    """Raise ConfigError naming the key to change."""
    _check_lr_schedule(config)
    _check_parallelism(config)
    _check_checkpoint(config)
    _check_activation_checkpoint(config)
    _check_files(config)
    _check_folders(config)
    _check_data(config)
    _check_profiling(config)
    _check_metrics(config)


def _check_metrics(config: JobConfig) -> None:
    import importlib.util

    if config.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("[metrics] enable_wandb: the wandb package is not installed (pip install wandb),"
                          " or set enable_wandb = false")


def _check_profiling(config: JobConfig) -> None:
    prof = config.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        raise ConfigError(
            f"[profiling] profiler_warmup={prof.profiler_warmup} + profiler_active={prof.profiler_active} must fit in"
            f" profile_freq={prof.profile_freq} steps"
        )
    last = config.training.steps
    for key in ("pipeline_timeline_steps", "activation_memory_steps"):
        steps = getattr(prof, key)
        bad = [s for s in steps if not 1 <= s <= MAX_COUNT]
        if bad:
            raise ConfigError(f"[profiling] {key}: {bad[0]} is not a step (steps count from 1 to {MAX_COUNT:,})")
        if past := [s for s in steps if s > last]:
            logger.warning("[profiling] %s: step%s %s after the last step ([training] steps = %d): not recorded",
                           key, "s" if len(past) > 1 else "", ", ".join(map(str, past)), last)
    if prof.pipeline_timeline_steps and config.parallelism.pipeline_parallel_degree == 1:
        logger.warning("[profiling] pipeline_timeline_steps set but pipeline_parallel_degree=1: no pipeline to time")


def warmup_steps(lr_scheduler: LRScheduler, steps: int) -> int:
    """Warm-up steps actually used: ``warmup_steps``, at most ``steps``."""
    return min(lr_scheduler.warmup_steps, steps)


def decay_steps(lr_scheduler: LRScheduler, steps: int) -> int:
    """Number of steps in the decay phase of the LR schedule, at most what warm-up leaves."""
    left = steps - warmup_steps(lr_scheduler, steps)
    if lr_scheduler.decay_ratio is None:
        return left
    return min(round(lr_scheduler.decay_ratio * steps), left)


def _check_lr_schedule(config: JobConfig) -> None:
    """A schedule longer than the run is shortened, with a warning naming the keys (so that a
    one-step smoke test of any job works): warm-up first, then decay."""
    lr, steps = config.lr_scheduler, config.training.steps
    if lr.warmup_steps > steps:
        logger.warning("[lr_scheduler] warmup_steps=%d exceeds [training] steps=%d: warming up over %d steps",
                       lr.warmup_steps, steps, steps)
    wanted = None if lr.decay_ratio is None else round(lr.decay_ratio * steps)
    if wanted is not None and wanted > decay_steps(lr, steps):
        logger.warning(
            "[lr_scheduler] decay_ratio=%g of [training] steps=%d is %d decay steps, but warm-up leaves %d: decaying"
            " over %d", lr.decay_ratio, steps, wanted, steps - warmup_steps(lr, steps), decay_steps(lr, steps))


def _check_parallelism(config: JobConfig) -> None:
    p, t = config.parallelism, config.training
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp > 1 and t.seq_len % (2 * cp):
        raise ConfigError(
            f"[training] seq_len={t.seq_len} must be divisible by 2 * [parallelism] context_parallel_degree={cp}"
            f" (each sequence is cut into {2 * cp} equal chunks, two per context-parallel rank)"
        )
    if tp > 1 and p.enable_sequence_parallel and (t.seq_len // cp) % tp:
        per_rank = f" / context_parallel_degree {cp} = {t.seq_len // cp} tokens per rank," if cp > 1 else ""
        raise ConfigError(
            f"[training] seq_len={t.seq_len}{per_rank} must be divisible by [parallelism] tensor_parallel_degree="
            f"{tp} for sequence parallelism (or set enable_sequence_parallel = false)"
        )
    for point in p.pipeline_parallel_split_points:
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.\w+)*", point):
            raise ConfigError(
                f"[parallelism] pipeline_parallel_split_points: {point!r} is not a module name like 'layers.4'"
                f" (got {p.pipeline_parallel_split_points})"
            )
    if p.pipeline_parallel_schedule_csv:
        _check_csv_syntax(p.pipeline_parallel_schedule_csv)
    if p.pipeline_parallel_device_memory_gbytes_per_second and not p.pipeline_parallel_device_tflops:
        raise ConfigError("[parallelism] pipeline_parallel_device_memory_gbytes_per_second: set"
                          " pipeline_parallel_device_tflops too (bytes are priced in seconds, beside the FLOPs)")
    # pipeline keys at pipeline_parallel_degree 1: PipelineParallel.check names every one in a single warning
    if p.tensor_parallel_overrides and p.tensor_parallel_plan != "auto":
        raise ConfigError("[parallelism.tensor_parallel_overrides] apply to tensor_parallel_plan = \"auto\" only")
    if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size} must divide"
            f" [training] local_batch_size={t.local_batch_size}"
        )
    if t.global_batch_size != -1 and p.data_parallel_shard_degree != -1:
        # The data-parallel degree is known without the world size: check the batch arithmetic now.
        check_batch(t, p.data_parallel_replicate_degree * p.data_parallel_shard_degree)


def _check_csv_syntax(path: str) -> None:
    """Every cell of a schedule CSV is an action like 0F1 (stage, F/B/I/W, microbatch) or empty (idle);
    whether its stages and microbatches fit the job is checked when the job is planned."""
    read_csv_cells(path)


def read_csv_cells(path: str) -> list[list[str]]:
    """The CSV's rows of stripped cells, read as torch reads them (csv module: a blank line is a rank
    with no actions; an empty cell is an idle slot). Raises ConfigError for an unreadable file, no
    rows, or a cell that is not a compute action like 0F1."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of a cell
            rows = [[cell.strip() for cell in row] for row in csv.reader(f)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"{CSV_KEY}: cannot read {path}: {e}") from None
    if not any(any(row) for row in rows):
        raise ConfigError(f"{CSV_KEY}: {path} is empty; one row of actions per pipeline rank is needed")
    for r, row in enumerate(rows):
        for cell in row:
            if cell and not re.fullmatch(r"\d+[FBIW]\d+", cell):
                raise ConfigError(
                    f"{CSV_KEY}: {path} row {r + 1}: {cell!r} is not an action like 0F1 (stage, F/B/I/W, microbatch)"
                )
    return rows




def check_batch(training: Training, dp: int) -> None:
    """global_batch_size must be a whole number of local batches over the data-parallel ranks."""
    if training.global_batch_size == -1:
        return
    per_step = training.local_batch_size * dp
    if training.global_batch_size % per_step != 0:
        raise ConfigError(
            f"[training] global_batch_size={training.global_batch_size} must be a multiple of local_batch_size"
            f" {training.local_batch_size} * data-parallel degree {dp} = {per_step}"
        )


def _check_checkpoint(config: JobConfig) -> None:
    for name in config.checkpoint.exclude_from_loading:
        if name == "lr_scheduler":
            raise ConfigError(
                "[checkpoint] exclude_from_loading: 'lr_scheduler' is not a separate part: the LR schedule follows the"
                " step counter; exclude 'train_state' to restart both"
            )
        if name.startswith("model.") and len(name) > len("model."):
            continue  # saved model tensors to leave behind (checked against the model when loading)
        if name not in CHECKPOINT_PARTS:
            raise ConfigError(
                f"[checkpoint] exclude_from_loading: unknown part {name!r} (parts: {', '.join(CHECKPOINT_PARTS)};"
                " or 'model.<name>' for saved model tensors the model lacks)"
            )
    ckpt = config.checkpoint
    if not ckpt.enable and ckpt.load_step != -1:
        logger.warning("[checkpoint] load_step=%d is ignored: [checkpoint] enable = false (no run checkpoint is"
                       " resumed)", ckpt.load_step)
    excluded = set(config.checkpoint.exclude_from_loading)
    if excluded >= set(CHECKPOINT_PARTS):
        raise ConfigError("[checkpoint] exclude_from_loading: every part is excluded, so a resume would load nothing"
                          " and overwrite the run's checkpoints; to start afresh, use another [job] dump_folder")
    if "model" in excluded and "optimizer" not in excluded:
        raise ConfigError("[checkpoint] exclude_from_loading: 'model' without 'optimizer' would load the optimizer"
                          " state of weights that are not loaded; exclude both to continue from fresh weights")


def _check_activation_checkpoint(config: JobConfig) -> None:
    ac, p = config.activation_checkpoint, config.parallelism
    option = ac.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):  # checked whatever the mode
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option: got {option!r}, expected 'op' or a positive integer"
        )
    schedule = p.pipeline_parallel_schedule
    split = (p.pipeline_parallel_degree > 1 and not p.pipeline_parallel_schedule_csv
             and SCHEDULES[schedule].split_backward)
    if split and ac.mode == "selective" and option == "op":
        raise ConfigError(
            f"[activation_checkpoint] selective_ac_option='op' cannot be used with [parallelism]"
            f" pipeline_parallel_schedule={schedule}: zero-bubble schedules run backward in two passes and"
            " per-op selective checkpointing allows one; use mode = full, or selective_ac_option = an integer"
        )


def output_folders(config: JobConfig) -> list[tuple[str, str, Path]]:
    """(key, value, folder) of every folder this run will write into; the ones under the dump folder are
    relative to it. Checked when the config is loaded and created by every rank at start, so that a bad
    path fails before the first step rather than at the first save or trace."""
    dump = Path(config.job.dump_folder)
    out = [("[job] dump_folder", config.job.dump_folder, dump)]
    if config.checkpoint.enable:
        out.append(("[checkpoint] folder", config.checkpoint.folder, dump / config.checkpoint.folder))
    if config.metrics.enable_tensorboard or config.metrics.enable_wandb:
        out.append(("[metrics] save_tb_folder", config.metrics.save_tb_folder, dump / config.metrics.save_tb_folder))
    prof = config.profiling
    if prof.enable_profiling or (prof.pipeline_timeline_steps and config.parallelism.pipeline_parallel_degree > 1):
        out.append(("[profiling] save_traces_folder", prof.save_traces_folder, dump / prof.save_traces_folder))
    if prof.enable_memory_snapshot:
        out.append(("[profiling] save_memory_snapshot_folder", prof.save_memory_snapshot_folder,
                    dump / prof.save_memory_snapshot_folder))
    t = config.training
    if t.dataset_mix or not is_prepared_path(t.dataset_path):  # raw text is tokenized into the cache first
        cache = t.dataloader.cache_folder
        out.append(("[training.dataloader] cache_folder", cache, dump / cache))
    return out


def _check_folders(config: JobConfig) -> None:
    """Folder names that are empty or name an existing file (whether they can be created and
    written is checked by every rank when the run starts)."""
    folders = output_folders(config)
    for key, name, _ in folders:
        if not name.strip():
            raise ConfigError(f"{key}: must not be empty (use '.' for the current folder)")
    for key, _, path in folders:
        try:
            is_file = path.exists() and not path.is_dir()
        except OSError:  # e.g. under a folder this user cannot read: reported when the run creates it
            continue
        if is_file:
            raise ConfigError(f"{key}: {path} exists and is not a folder")


def _check_files(config: JobConfig) -> None:
    for key, path in (
        ("[training] dataset_path", config.training.dataset_path),
        ("[validation] dataset_path", config.validation.dataset_path if config.validation.enable else ""),
        ("[model] tokenizer_path", config.model.tokenizer_path),
        ("[parallelism] pipeline_parallel_schedule_csv", config.parallelism.pipeline_parallel_schedule_csv),
        ("[checkpoint] initial_load_path", config.checkpoint.initial_load_path),
    ):
        try:
            found = not path or Path(path).exists()
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
        if not found and key == "[checkpoint] initial_load_path":
            found = is_hub_id(path)  # a Hugging Face Hub id: the plan fetches it (trainer.hub)
        if not found:
            raise not_found(key, path)
        if path and key in _FILE_KEYS and Path(path).is_dir():
            raise not_found(key, path, "a folder, not a file")


@dataclass(frozen=True)
class MixEntry:
    """One dataset of [training.dataset_mix]: its weight and the split it reads, with where that split is set."""

    name: str
    weight: float
    split: str
    own_split: bool  # set in the entry; else [training.dataloader] split

    @property
    def split_key(self) -> str:
        """The key that sets this dataset's split (named in errors and in the logged mix)."""
        return f"[training.dataset_mix] {self.name!r} split" if self.own_split else "[training.dataloader] split"


def mix_entries(training: Training) -> list[MixEntry]:
    """The datasets of [training.dataset_mix], each entry a weight or a table {weight = 3, split = "..."}; a
    dataset without its own split reads [training.dataloader] split. Raises ConfigError naming a bad entry."""
    out = []
    for name, entry in training.dataset_mix.items():
        key = f"[training.dataset_mix] {name!r}"
        if not name.strip():
            raise ConfigError("[training.dataset_mix]: an empty dataset name")
        split, own_split = training.dataloader.split, False
        weight = entry
        if isinstance(entry, dict):
            extra = sorted(set(entry) - {"weight", "split"})
            if extra or "weight" not in entry:
                raise ConfigError(f"{key}: expected a weight or a table {{weight = 1, split = \"train\"}}, got"
                                  f" {entry!r}" + (f" (unknown: {', '.join(extra)})" if extra else " (no weight)"))
            weight = entry["weight"]
            if "split" in entry:
                if not isinstance(entry["split"], str) or not entry["split"].strip():
                    raise ConfigError(f"{key}: split {entry['split']!r} is not a split name such as 'train[:90%]'")
                split, own_split = entry["split"], True
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{key}: weight {weight!r} is not a number")
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(f"{key}: weight {weight} must be a finite number > 0")
        out.append(MixEntry(name, float(weight), split, own_split))
    return out


def data_identity(training: Training) -> str:
    """What the training data are, as a checkpoint records them: the datasets, their weights and splits."""
    d = training.dataloader
    config = f" ({d.subset})" if d.subset else ""
    if training.dataset_mix:
        return "the mix " + ", ".join(f"{e.name} x{e.weight:g} [{e.split}]" for e in mix_entries(training))
    if training.dataset_path:
        return f"{training.dataset_path} [{d.split}]"
    return f"{training.dataset}{config} [{d.split}]"


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` names a Hugging Face Hub model (``org/name``) rather than a path that exists here."""
    try:
        if Path(text).exists():
            return False
    except (OSError, ValueError):
        return False
    return bool(_HUB_ID.fullmatch(text))


def is_prepared_path(path: str) -> bool:
    """Whether ``path`` holds prepared token shards (its index.json), read whole whatever split is configured;
    here rather than in trainer.data so that checking a config does not import the data package."""
    return bool(path) and (Path(path) / "index.json").is_file()


def _check_data(config: JobConfig) -> None:
    """Dataset mixture entries; what validation needs of the training shape."""
    t = config.training
    mix_entries(t)
    if t.dataset_mix and t.dataset_path:
        logger.warning("[training] dataset_path is ignored: [training.dataset_mix] names the datasets")
    v = config.validation
    if not v.enable and v.dataset_path:
        logger.warning("[validation] dataset_path is ignored: [validation] enable = false")
    for key, path, split, used in (("[training.dataloader] split", t.dataset_path, t.dataloader.split,
                                    not t.dataset_mix), ("[validation] split", v.dataset_path, v.split, v.enable)):
        if used and split != "train" and is_prepared_path(path):
            logger.warning("%s = %r does not apply to %s: prepared token shards are read whole (prepare the split"
                           " you want with python -m trainer.prepare)", key, split, path)
    if v.enable and not t.dataset_mix and (v.dataset_path or v.dataset) == (t.dataset_path or t.dataset) and (
            v.split == t.dataloader.split):
        logger.warning("[validation] reads the training data itself (%s, split %r): the validation loss measures"
                       " how well the model fits its training text; give [validation] split another slice, e.g."
                       " 'train[90%%:]' with [training.dataloader] split = 'train[:90%%]'", v.dataset_path or v.dataset,
                       v.split)
    for name in t.dataset_mix:  # a name that looks like a file path must be one (hub names look like org/name)
        if not Path(name).exists() and (name.startswith((".", "/", "~")) or Path(name).suffix in _RAW_SUFFIXES):
            raise not_found(f"[training.dataset_mix] {name!r}", name)
    if t.dataset_mix and t.dataloader.streaming and any(not Path(n).exists() and n != "python_docs"
                                                          for n in t.dataset_mix):
        raise ConfigError("[training.dataset_mix] mixes prepared or downloaded datasets only: set"
                          " [training.dataloader] streaming = false for hub datasets in the mix")
