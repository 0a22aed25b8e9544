"""Convert checkpoints to and from Hugging Face folders, in one process (no distributed launch).

    python -m trainer.convert to-hf CHECKPOINT_STEP_FOLDER OUT_FOLDER [--job.config_file JOB.toml] [--dtype bfloat16]
    python -m trainer.convert from-hf HF_FOLDER OUT_FOLDER

``to-hf`` reads any DCP checkpoint this trainer wrote (a full ``step-N`` or a weights-only
``model-step-N``, saved on any layout) and writes config.json, safetensors with their index,
generation_config.json and the tokenizer, which transformers' ``AutoModelForCausalLM`` and
``AutoTokenizer`` load. The job config is the run's own ``config.toml`` (in its dump folder)
unless ``--job.config_file`` names one; further ``--section.key value`` arguments override it.

``from-hf`` turns a Hugging Face model folder (a family with an HF mapping: Llama, Qwen 3 MoE)
into ``OUT_FOLDER/checkpoint`` (a DCP seed checkpoint of the weights), ``OUT_FOLDER/tokenizer.json``
(when the folder has one) and ``OUT_FOLDER/model.toml``: the ``[model]`` that config.json
describes and ``[checkpoint] initial_load_path``. A job file that ``extends`` it trains from
those weights. Bad input prints one line and exits 2.
"""

import argparse
import contextlib
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.parallel.dims import ParallelDims
from trainer.jsonfile import read_json
from trainer.errors import ConfigError, UserError, error_lines, one_line

logger = logging.getLogger("trainer.convert")
USAGE = ("usage: python -m trainer.convert to-hf CHECKPOINT_STEP_FOLDER OUT_FOLDER [--job.config_file FILE]"
         " [--dtype DTYPE] [--section.key value ...]\n"
         "       python -m trainer.convert from-hf HF_FOLDER OUT_FOLDER")


@dataclass
class Loaded:
    """A whole model in one process, with what describes it."""

    model: Any
    spec: Any
    args: Any
    tokenizer: Any
    """The tokenizer it was trained with (None: an HF folder without tokenizer.json)."""
    section: Any
    """The ``[model]`` section that describes it."""
    stop_ids: tuple[int, ...] = ()
    """End-of-generation ids besides the tokenizer's end-of-text (a folder's generation_config.json)."""
    context: tuple[int, str] | None = None
    """(the positions the model was made for, where that number comes from), if known."""


def check_new_folder(out: Path, key: str) -> None:
    """The output goes into a new or empty folder: nothing of the user's is overwritten."""
    try:
        taken = out.exists() and (not out.is_dir() or any(out.iterdir()))
    except OSError as e:
        raise UserError(f"{key}: cannot use {out} ({e.strerror or e})") from None
    if taken:
        raise UserError(f"{key}: {out} exists and is not an empty folder; name a new folder")


@contextlib.contextmanager
def output_folder(out: Path, key: str):
    """Create ``out`` (a new or empty folder) for a command's output; if the command fails, what it created is
    removed again, so nothing half-written is left behind."""
    check_new_folder(out, key)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{key}: cannot create {out} ({e.strerror or e})") from None
    try:
        yield out
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:  # an empty folder the user gave: emptied again
            for child in out.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise


def job_config_of(step: Path, key: str) -> Path:
    """The ``config.toml`` a run dumped, found above its checkpoint step folder."""
    for folder in list(step.resolve().parents)[:4]:
        if (folder / "config.toml").is_file():
            return folder / "config.toml"
    raise UserError(f"{key}: no config.toml found above {step} (a run writes it into its dump folder); name the job"
                    " file with --job.config_file")


def check_step_folder(path: Path, key: str) -> None:
    """A DCP checkpoint of one step, not the folder of checkpoints above it; damage named."""
    from trainer.checkpoint import complete_steps, find_damage
    from trainer.errors import not_found

    if not path.is_dir():
        raise not_found(key, path, "folder not found")
    if not (path / ".metadata").is_file():
        steps = complete_steps(path)
        hint = f"; it holds checkpoints, name one: {', '.join(f'{path}/step-{s}' for s in steps)}" if steps else ""
        raise UserError(f"{key}: {path} is not a checkpoint step folder (it has no .metadata){hint}")
    if damage := find_damage(path):
        raise UserError(f"{key}: {path} is damaged: {damage}")


def check_one_process(spec, args) -> None:
    """What the family refuses for these args in one process (e.g. sequences past a scaling's range)."""
    if why := spec.job_limits(args, ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)):
        raise UserError(why)


def load_checkpoint(step: Path, overrides: list[str], *, key: str, seq_len: int | None = None, device="cpu",
                    dtype=None) -> Loaded:
    """The model of a DCP step folder, whole, in this process, with the job's tokenizer. ``overrides`` are
    ``--section.key value`` arguments (``--job.config_file`` among them, else the run's config.toml)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.config import load_config
    from trainer.data.tokenizer import build_tokenizer
    from trainer.models import get_model_spec, import_model_modules, resolve_model_args
    from trainer.models.init import materialize_
    from trainer.plan import adopt_imported_model

    check_step_folder(step, key)
    given = any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in overrides)
    config_file = None if given else job_config_of(step, key)
    config = load_config(config_file, overrides)
    import_model_modules(config.model.modules)
    spec = get_model_spec(config.model.name)
    config = adopt_imported_model(config, spec)
    args = spec.with_seq_len(resolve_model_args(spec, config.model), seq_len or config.training.seq_len)
    check_one_process(spec, args)
    model = spec.meta_model(args)
    materialize_(model, torch.device(device), seed=0)
    aliases = spec.tied_aliases(args)
    state = {k: v for k, v in model.state_dict().items() if k not in aliases}  # tied: saved once, canonical name
    saved = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    saved_model = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    if not saved_model:
        raise UserError(f"{key}: {step} holds no model weights")
    missing, extra = sorted(set(state) - saved_model), sorted(saved_model - set(state))
    if missing or extra:
        what = "; ".join(f"{label} {len(names)} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                         for label, names in (("the checkpoint lacks", missing), ("the model lacks", extra)) if names)
        raise UserError(f"{key}: {step} was not saved from the model {config_file or 'the job file'} describes"
                        f" ({config.model.name} {config.model.flavor}): {what}; name the run's job file with"
                        " --job.config_file")
    from trainer.checkpoint import dcp_errors, first_failure

    try:
        dcp.load({"model": state}, checkpoint_id=str(step))
    except dcp_errors() as e:  # DCP wraps shape mismatches in CheckpointException (a BaseException)
        cause = first_failure(e)
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"{key}: cannot load {step} into {config.model.name} {config.model.flavor} ({first[:300]});"
                        " was it saved from another model shape?") from None
    cast_parameters_(model, dtype)
    from trainer.hf import model_context

    own = model_context(spec, config.model) or 0
    context = ((own, "the model's max_seq_len") if own > config.training.seq_len
               else (config.training.seq_len, "the run's [training] seq_len"))
    return Loaded(model.eval(), spec, args, build_tokenizer(config.model, spec.vocab_size(args)), config.model,
                  context=context)


def cast_parameters_(model, dtype) -> None:
    """Parameters to ``dtype`` (None: as they are); buffers keep theirs (the rotary table stays float32)."""
    if dtype is None:
        return
    import torch

    with torch.no_grad():
        for param in model.parameters():  # a tied weight is one Parameter: cast once
            param.data = param.data.to(dtype)


def best_flavor(config: dict, spec, folder: Path, key: str) -> tuple[str, dict, bool]:
    """(flavor, overrides, tied) with the fewest overrides that describe config.json's model."""
    from trainer.hf import hf_model_args

    options = [(flavor, *hf_model_args(config, spec, flavor, folder, key)) for flavor in spec.flavors]
    return min(options, key=lambda o: len(o[1]))


def load_hf(folder: Path, *, key: str, seq_len: int, device="cpu", dtype=None) -> Loaded:
    """The model of a Hugging Face folder, whole, in this process; its tokenizer.json when it has one."""
    import torch

    from trainer.config.schema import Model
    from trainer.data.tokenizer import HFTokenizer
    from trainer.hf import hf_family, is_hf_folder, load_hf_, read_hf_config
    from trainer.models import resolve_model_args
    from trainer.models.init import materialize_

    if not is_hf_folder(folder):
        raise UserError(f"{key}: {folder} is not a Hugging Face model folder (no *.safetensors)")
    config = read_hf_config(folder, key)
    spec = hf_family(config, folder, key)
    flavor, overrides, tied = best_flavor(config, spec, folder, key)  # tie_embeddings among overrides if it differs
    section = Model(name=spec.name, flavor=flavor, overrides=overrides, tie_embeddings=tied)
    try:
        args = spec.with_seq_len(resolve_model_args(spec, section), seq_len)
    except ConfigError as e:  # config.json values the family cannot build (a vocab_size of null, ...)
        raise UserError(f"{key}: {folder}/config.json describes a model {spec.name} cannot build: {e}") from None
    check_one_process(spec, args)
    model = spec.meta_model(args)
    materialize_(model, torch.device(device), seed=0)
    load_hf_([model], spec, args, folder, key=key)
    cast_parameters_(model, dtype)
    tokenizer = HFTokenizer(folder / "tokenizer.json", key=key) if (folder / "tokenizer.json").is_file() else None
    positions = config.get("max_position_embeddings")
    context = ((positions, "its config.json max_position_embeddings")
               if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None)
    return Loaded(model.eval(), spec, args, tokenizer, section, _stop_ids(folder, key), context)


def _stop_ids(folder: Path, key: str) -> tuple[int, ...]:
    """``eos_token_id`` of a Hugging Face folder's generation_config.json (an id or a list), if any."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    given = read_json(path, key, what="generation config").get("eos_token_id")
    ids = [given] if isinstance(given, int) else given if isinstance(given, list) else [] if given is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UserError(f"{key}: {path} eos_token_id = {given!r}: expected a token id or a list of them")
    return tuple(ids)


def to_hf(step: Path, out: Path, overrides: list[str], dtype_name: str | None) -> str:
    import torch

    from trainer.dtypes import torch_dtype
    from trainer.hf import export_hf

    key = "to-hf CHECKPOINT_STEP_FOLDER"
    check_new_folder(out, "to-hf OUT_FOLDER")
    if dtype_name not in (None, "float32", "bfloat16", "float16"):
        raise UserError(f"--dtype {dtype_name}: use float32, bfloat16 or float16")
    loaded = load_checkpoint(step, overrides, key=key)
    if loaded.spec.hf is None:
        raise UserError(f"{key}: model family {loaded.spec.name} has no Hugging Face mapping (ModelSpec.hf)")
    if why := loaded.spec.hf.unsupported(loaded.args):
        raise UserError(f"{key}: the Hugging Face class of {loaded.spec.name} cannot hold this model: {why}")
    dtype = torch_dtype(dtype_name) if dtype_name else torch.float32
    with output_folder(out, "to-hf OUT_FOLDER"):
        try:
            export_hf([loaded.model], loaded.spec, loaded.args, out, dtype, pp_rank=0, pp=1, writer=True,
                      tokenizer=loaded.tokenizer, context=loaded.context and loaded.context[0])
        except OSError as e:  # a full disk, a quota
            raise UserError(f"to-hf OUT_FOLDER: cannot write {out} ({e.strerror or e})") from None
    return f"wrote {out}: {loaded.spec.name} weights in {str(dtype).removeprefix('torch.')}, config.json, tokenizer"


def from_hf(folder: Path, out: Path) -> str:
    from trainer.errors import not_found
    from trainer.hub import hub_folder, is_hub_id

    key = "from-hf HF_FOLDER"
    check_new_folder(out, "from-hf OUT_FOLDER")
    if is_hub_id(str(folder)):
        folder = hub_folder(str(folder), key)
    if not folder.is_dir():
        raise not_found(key, folder, "folder not found")
    loaded = load_hf(folder, key=key, seq_len=1)
    section = loaded.section
    flavor, overrides, tied = section.flavor, section.overrides, section.tie_embeddings
    vocab = loaded.spec.vocab_size(loaded.args)
    if loaded.tokenizer is not None and loaded.tokenizer.vocab_size > vocab:
        raise UserError(f"{key}: {folder}/tokenizer.json has {loaded.tokenizer.vocab_size:,} tokens and the model's"
                        f" vocabulary {vocab:,}: the ids past {vocab - 1:,} have no embedding")
    with output_folder(out, "from-hf OUT_FOLDER"):
        try:
            return _write_seed(loaded, folder, out, flavor, overrides, tied)
        except OSError as e:  # a full disk, a quota
            raise UserError(f"from-hf OUT_FOLDER: cannot write {out} ({e.strerror or e})") from None


def _write_seed(loaded, folder: Path, out: Path, flavor: str, overrides: dict, tied: bool) -> str:
    """The seed checkpoint, tokenizer and model.toml of ``from-hf`` into the new folder ``out``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import merge_shares
    from trainer.config.render import toml_value

    seed = out / "checkpoint"
    aliases = loaded.spec.tied_aliases(loaded.args)
    state = {k: v.to(torch.float32) for k, v in loaded.model.state_dict().items() if k not in aliases}
    dcp.save({"model": state}, checkpoint_id=str(seed))
    merge_shares(seed)  # checksums.json, checked when a run loads it
    lines = ["# Written by python -m trainer.convert from-hf: the model of", f"# {folder.resolve()}",
             "# Extend it from your job file: extends = \"<this file>\"", "", "[model]",
             f"name = {toml_value(loaded.spec.name)}", f"flavor = {toml_value(flavor)}",
             f"tie_embeddings = {toml_value(tied)}"]
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_hf(out)
        lines.append(f"tokenizer_path = {toml_value(str((out / 'tokenizer.json').resolve()))}")
    if overrides:
        lines += ["", "[model.overrides]", *(f"{k} = {toml_value(v)}" for k, v in overrides.items())]
    lines += ["", "[checkpoint]", f"initial_load_path = {toml_value(str(seed.resolve()))}", ""]
    (out / "model.toml").write_text("\n".join(lines))
    tokenizer = ("tokenizer.json, " if loaded.tokenizer is not None
                 else "no tokenizer (the folder has no tokenizer.json), ")
    return (f"wrote {out}: checkpoint (DCP), {tokenizer}model.toml"
            f" ({loaded.spec.name} {flavor}, {len(overrides)} overrides)")


def run(argv: list[str]) -> int:
    from trainer.log import init_config_logging

    init_config_logging()
    if (status := help_or_usage(argv, __doc__, USAGE)) is not None:
        return status
    parser = CommandParser("python -m trainer.convert", USAGE)
    parser.add_argument("direction", choices=["to-hf", "from-hf"])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--dtype", default=None)
    began = time.monotonic()
    try:
        known, rest = parser.parse_known_args(argv)
        if known.direction == "from-hf":
            if rest or known.dtype:
                raise UserError(f"from-hf takes HF_FOLDER OUT_FOLDER only (got {' '.join(rest) or '--dtype'})")
            done = from_hf(Path(known.source), Path(known.out))
        else:
            done = to_hf(Path(known.source), Path(known.out), rest, known.dtype)
    except UserError as e:
        return report(e, USAGE)
    print(f"{done} ({time.monotonic() - began:.1f} s)")
    return 0


class UsageError(UserError):
    """The command line itself is wrong (an unknown choice, a missing argument): the usage follows the error."""


class CommandParser(argparse.ArgumentParser):
    """The commands' argument parser: its mistakes are UsageErrors, reported like every user error (one
    ``error:`` line, exit 2) instead of argparse's own exit; unknown ``--section.key value`` pairs are left
    over for the config (``parse_known_args``)."""

    def __init__(self, prog: str, usage: str):
        super().__init__(prog=prog, usage=usage, add_help=False, allow_abbrev=False)

    def error(self, message: str):
        raise UsageError(message)


def help_or_usage(argv: list[str], doc: str, usage: str) -> int | None:
    """A command's exit status when it is asked for help (its docstring, 0) or given nothing (its usage, 2);
    None otherwise."""
    if argv and argv[0] not in ("-h", "--help"):
        return None
    print(doc.strip() if argv else usage, file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2


def command_device(requested: str, kinds: tuple[str, ...], hint: str) -> str:
    """The device a command runs on: ``requested`` (``--device``; empty: cuda where available, else cpu),
    refused with one line when its kind is not in ``kinds`` (``hint`` says which are) or it is not usable here."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in kinds:
        raise UserError(f"--device {device}: {hint}")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # an unknown device name, or CUDA not available
        raise UserError(f"--device {device}: not usable here ({one_line(e)[:200]})") from None
    return device


def report(error: UserError, usage: str) -> int:
    """Print a command's user error (and the usage after a command-line mistake); the exit status, 2."""
    for line in error_lines(error):
        print(f"error: {line}", file=sys.stderr)
    if isinstance(error, UsageError):
        print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
