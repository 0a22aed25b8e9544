"""Load a JobConfig: schema defaults < TOML file (and the files it extends) < command line.

Values are kept in a flat map from key path to (value, origin) until the very end, so every
error can name the key, the bad value, what is accepted and where the value came from.
"""

import difflib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainer.config.fields import FieldSpec, check_value, parse_cli_value, parse_toml_literal, section_fields
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError, ConfigErrors, not_found

Flat = dict[tuple[str, ...], tuple[Any, str]]
Action = Literal["train", "help", "print-config", "dry-run"]

CLI = "command line"
EXTENDS_KEY = "extends"
_DICT_EXAMPLES = {"overrides": "n_layers 4", "tensor_parallel_overrides": "attention.wq colwise",
                  "dataset_mix": "python_docs 1"}
_ACTION_FLAGS: dict[str, Action] = {
    "--help": "help",
    "-h": "help",
    "--print-config": "print-config",
    "--dry-run": "dry-run",
}



@dataclass(frozen=True)
class Invocation:
    """What the command line asked for: a config and what to do with it."""

    config: JobConfig
    action: Action
    world_size: int | None = None
    """--world-size N (for --dry-run), if given."""
    compare_schedules: bool = False
    """--compare-schedules (for --dry-run): plan the pipeline under every schedule of the table too."""


def key_name(path: tuple[str, ...]) -> str:
    """How a key is named in messages: ``[training.dataloader] split``."""
    path = tuple(p if p.isidentifier() else repr(p) for p in path)  # make odd names visible
    if len(path) == 1:
        return f"[{path[0]}]"
    return f"[{'.'.join(path[:-1])}] {path[-1]}"


def _find_key_elsewhere(key: str) -> list[str]:
    """Sections (other than where it was written) that do have a key of this name."""
    hits = []

    def walk(cls: type, prefix: tuple[str, ...]) -> None:
        for name, spec in section_fields(cls).items():
            if spec.kind == "section":
                walk(spec.section, prefix + (name,))
            elif name == key and prefix:
                hits.append(key_name(prefix + (name,)))

    walk(JobConfig, ())
    return hits


def _unknown_key(prefix: tuple[str, ...], key: str, fields: dict[str, FieldSpec], origin: str) -> ConfigError:
    what = "section" if not prefix else "key"
    msg = f"{key_name(prefix + (key,))}: unknown {what} ({origin})"
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    elsewhere = _find_key_elsewhere(key)
    if close:
        msg += f"; did you mean '{close[0]}'?"
    elif elsewhere:
        msg += f"; did you mean {' or '.join(elsewhere)}?"
    else:
        msg += f"; valid {what}s: {', '.join(fields)}"
    return ConfigError(msg)


def _flatten(data: dict, cls: type, prefix: tuple[str, ...], origin: str, out: Flat,
             unknown: list[ConfigError]) -> None:
    """Add ``data``'s keys to ``out``; each unknown section or key is added to ``unknown`` (so that a
    file's every misspelling is reported at once) and the rest of the file is still read."""
    fields = section_fields(cls)
    for key, value in data.items():
        spec = fields.get(key)
        if spec is None:
            unknown.append(_unknown_key(prefix, key, fields, origin))
            continue
        path = prefix + (key,)
        if spec.kind in ("section", "dict"):
            if not isinstance(value, dict):
                raise ConfigError(f"{key_name(path)}: must be a table, got {value!r} ({origin})")
            if spec.kind == "section":
                _flatten(value, spec.section, path, origin, out, unknown)
            else:
                for entry, entry_value in value.items():
                    out[path + (entry,)] = (entry_value, origin)
        elif path == ("job", "config_file"):
            raise ConfigError(f"[job] config_file: can only be given on the command line ({origin})")
        else:
            out[path] = (value, origin)


def read_toml(path: str | Path, _chain: tuple[Path, ...] = ()) -> Flat:
    """Read a TOML job file and the files it extends, as a flat map (later files win)."""
    path = Path(path)
    try:
        resolved = path.resolve()
        is_file, exists = path.is_file(), path.exists()
    except (OSError, ValueError) as e:  # a name too long, a NUL character
        raise ConfigError(f"[job] config_file: cannot use {str(path)!r}: {e}") from None
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in _chain + (resolved,))
        raise ConfigError(f"{EXTENDS_KEY}: cycle between config files: {cycle}")
    if not is_file:
        raise not_found("[job] config_file", path, "not a regular file" if exists else "file not found")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
    flat: Flat = {}
    base = data.pop(EXTENDS_KEY, None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{EXTENDS_KEY}: expected a file name string, got {base!r} ({path})")
        flat.update(read_toml(path.parent / base, _chain + (resolved,)))
    unknown: list[ConfigError] = []
    _flatten(data, JobConfig, (), str(path), flat, unknown)
    if len(unknown) == 1:
        raise unknown[0]
    if unknown:
        raise ConfigErrors(unknown)
    return flat


def _resolve_cli_key(raw: str) -> tuple[tuple[str, ...], FieldSpec | None, bool]:
    """Map '--section.key' text to (path, spec, negated); spec is None for a dict entry."""
    segments = [s.replace("-", "_") for s in raw.split(".")]
    if any(not s.isidentifier() for s in segments):
        raise ConfigError(f"{'--' + raw!r}: malformed option name; options look like --section.key value")
    cls, path = JobConfig, ()
    for i, seg in enumerate(segments):
        fields = section_fields(cls)
        spec = fields.get(seg)
        last = i == len(segments) - 1
        if spec is None and last and seg.startswith("no_") and path:
            negated = fields.get(seg[3:])
            if negated is not None and negated.kind == "bool":
                return path + (seg[3:],), negated, True
        if spec is None:
            raise _unknown_key(path, seg, fields, CLI)
        path = path + (seg,)
        if spec.kind == "section":
            if last:
                first = next(iter(section_fields(spec.section)))
                raise ConfigError(f"--{raw}: names a section, not a key; e.g. --{raw}.{first}")
            cls = spec.section
        elif spec.kind == "dict":
            if len(segments) == i + 1:
                example = _DICT_EXAMPLES.get(seg, "name value")
                raise ConfigError(f"--{raw}: set one entry at a time, e.g. --{raw}.{example}")
            # Entries may be dotted module names: --parallelism.tensor_parallel_overrides.attention.wq
            return path + (".".join(raw.split(".")[i + 1:]),), None, False
        elif not last:
            raise ConfigError(f"--{raw}: {key_name(path)} is a key, not a section")
        else:
            return path, spec, False
    raise AssertionError("unreachable")


def _is_utf8(text: str) -> bool:
    """False for bytes the shell passed that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


COMPARE_SCHEDULES = "--compare-schedules"


def parse_cli(argv: list[str]) -> tuple[Flat, Action, int | None, bool]:
    """Parse overrides, action flags, --world-size and --compare-schedules; values come back typed and checked."""
    flat: Flat = {}
    action: Action = "train"
    world_size, compare = None, False
    for j, token in enumerate(argv):
        if not _is_utf8(token):
            where = argv[j - 1] if j and argv[j - 1].startswith("--") and "=" not in argv[j - 1] else token
            raise ConfigError(f"{where.split('=')[0]!r}: the value is not valid UTF-8 text ({token!r})")
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--world-size" or token.startswith("--world-size="):
            text = token.partition("=")[2] if "=" in token else (argv[i] if i < len(argv) else "")
            i += 0 if "=" in token else 1
            if not text.isdigit() or int(text) < 1:
                raise ConfigError(f"--world-size: got {text!r}, expected a positive integer (ranks to plan for)")
            world_size = int(text)
            continue
        if token in _ACTION_FLAGS:
            action = _ACTION_FLAGS[token] if action == "train" else action
            continue
        if token == COMPARE_SCHEDULES:
            compare = True
            continue
        if token.startswith(COMPARE_SCHEDULES + "="):
            raise ConfigError(f"{COMPARE_SCHEDULES}: takes no value (got {token!r})")
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}; options look like --section.key value")
        raw, has_eq, text = token[2:].partition("=")
        path, spec, negated = _resolve_cli_key(raw)
        name = key_name(path)
        if negated:
            if has_eq:
                raise ConfigError(f"--{raw}: takes no value; use --{raw[3:] if raw.startswith('no') else raw}={text}")
            flat[path] = (False, CLI)
            continue
        if not has_eq:
            is_bool = spec is not None and spec.kind == "bool"
            nxt = argv[i] if i < len(argv) else None
            if is_bool:
                if nxt is not None and nxt.lower() in ("true", "false"):
                    text, i = nxt, i + 1
                else:
                    text = "true"
            elif nxt is None or nxt.startswith("--") or nxt in _ACTION_FLAGS:
                raise ConfigError(f"--{raw}: missing value ({name} expects {spec.accepted() if spec else 'a value'})")
            else:
                text, i = nxt, i + 1
        try:
            if spec is None:  # an entry of a free-form table such as [model.overrides]
                try:
                    value = parse_toml_literal(text)
                except ConfigError:
                    value = text
            else:
                value = parse_cli_value(spec, text)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e} ({CLI})") from None
        flat[path] = (value, CLI)
    return flat, action, world_size, compare


def _build(cls: type, flat: Flat, prefix: tuple[str, ...]) -> Any:
    kwargs = {}
    for name, spec in section_fields(cls).items():
        path = prefix + (name,)
        if spec.kind == "section":
            kwargs[name] = _build(spec.section, flat, path)
            continue
        if spec.kind == "dict":
            entries = {p[-1]: v for p, v in flat.items() if p[:-1] == path}
            if not entries:
                continue
            value = {k: v for k, (v, _) in entries.items()}
            origin = ", ".join(sorted({o for _, o in entries.values()}))
        elif path in flat:
            value, origin = flat[path]
        else:
            continue
        if value is None and spec.optional:
            kwargs[name] = None
            continue
        try:
            kwargs[name] = check_value(spec, value)
        except ConfigError as e:
            raise ConfigError(f"{key_name(path)}: {e} ({origin})") from None
    return cls(**kwargs)


def load_config(config_file: str | Path | None = None, overrides: list[str] = ()) -> JobConfig:
    """Load and validate a config from an optional TOML file plus command-line style overrides."""
    argv = list(overrides)
    if config_file is not None:
        argv = ["--job.config_file", str(config_file)] + argv
    return parse_args(argv).config


def parse_args(argv: list[str]) -> Invocation:
    """Parse a full command line (``train.py`` arguments) into a validated config and an action.

    Only what the config alone can show is checked here; the job plan checks the rest.
    """
    from trainer.config.validate import validate_config

    if "--help" in argv or "-h" in argv:  # help must work even when the rest is broken
        return Invocation(JobConfig(), "help")
    cli, action, world_size, compare = parse_cli(argv)
    if world_size is not None and action != "dry-run":
        raise ConfigError("--world-size: only used with --dry-run (a real run takes its world size from torchrun)")
    if compare and action != "dry-run":
        raise ConfigError(f"{COMPARE_SCHEDULES}: only used with --dry-run (it plans the pipeline under every schedule"
                          " and prints the predictions)")
    config_file = cli.get(("job", "config_file"), ("", CLI))[0]
    flat: Flat = read_toml(config_file) if config_file else {}
    flat.update(cli)
    config = _build(JobConfig, flat, ())
    validate_config(config)
    if compare and config.parallelism.pipeline_parallel_degree == 1:
        raise ConfigError(f"{COMPARE_SCHEDULES}: [parallelism] pipeline_parallel_degree is 1, so there is no pipeline"
                          " schedule to compare; set it to 2 or more")
    return Invocation(config, action, world_size, compare)
