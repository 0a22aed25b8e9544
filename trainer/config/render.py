"""Text forms of the schema and of a config: --help, the key reference, resolved TOML."""

import re
from typing import Any

from trainer.config.fields import FieldSpec, section_fields
from trainer.config.schema import JobConfig

# Not written into the resolved config: it names the file being loaded, not a setting.
_NOT_DUMPED = {("job", "config_file")}


def walk_sections(cls: type, prefix: tuple[str, ...] = ()):
    """Yield (section path, {key: FieldSpec}) for every table, nested ones included."""
    leaves = {n: s for n, s in section_fields(cls).items() if s.kind != "section"}
    if prefix:
        yield prefix, leaves
    for name, spec in section_fields(cls).items():
        if spec.kind == "section":
            yield from walk_sections(spec.section, prefix + (name,))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


# TOML basic strings forbid U+0000-U+001F (tab aside) and U+007F unescaped; the rest is written as is.
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_string(text: str) -> str:
    return '"' + _NEEDS_ESCAPE.sub(lambda m: _ESCAPES.get(m.group(), f"\\u{ord(m.group()):04x}"), text) + '"'


def _toml_key(key: str) -> str:
    """A table key: bare where TOML allows it, else quoted (``"layers.0.attention.wq"`` stays one key)."""
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def default_text(spec: FieldSpec) -> str:
    if spec.default is None:
        return "unset"
    return toml_value(spec.default)


def config_sections(config: JobConfig):
    """Yield (section path, {key: value}) for every table of the resolved config, nested ones included, without
    ``job.config_file`` (it names the file being loaded, not a setting); an unset optional's value is None."""
    for path, fields in walk_sections(JobConfig):
        section = config
        for name in path:
            section = getattr(section, name)
        yield path, {name: getattr(section, name) for name in fields if path + (name,) not in _NOT_DUMPED}


# Keys naming files the job plan reads (the tokenizer and datasets are compared once open: trainer.agreement).
PLAN_FILE_KEYS = ("pipeline_parallel_cost_file", "pipeline_parallel_schedule_csv")
# Paths the ranks compare by what they opened, not by name (the same-data check): node-local copies of the same
# files may sit at other paths on other nodes.
OPENED_KEYS = {("training", "dataset_path"), ("validation", "dataset_path"), ("model", "tokenizer_path")}


def config_fingerprint(config: JobConfig) -> dict[str, str]:
    """What ranks compare at start (``trainer.agreement``), in the order a difference is reported: every key
    (``[section] key``: its TOML value, ``unset`` for an unset optional), then the contents of each file the plan
    reads (``[parallelism] <key> (contents of <path>)``: a digest; the same path may hold other files on other
    nodes). Not the paths in ``OPENED_KEYS``, whose contents the ranks compare once open; a table's entries in
    key order (the command line may give them in any)."""
    import hashlib

    def text(value) -> str:
        if value is None:
            return "unset"
        return toml_value(dict(sorted(value.items())) if isinstance(value, dict) else value)

    entries = {f"[{'.'.join(path)}] {name}": text(value) for path, values in config_sections(config)
               for name, value in values.items() if path + (name,) not in OPENED_KEYS}
    for key in PLAN_FILE_KEYS:
        name = getattr(config.parallelism, key)
        if not name:
            continue
        try:
            with open(name, "rb") as f:
                digest = "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()[:16]
        except OSError as e:  # the plan read it moments ago; if it is gone now, that is what differs
            digest = f"unreadable ({e.strerror or e})"
        entries[f"[parallelism] {key} (contents of {name})"] = digest
    return entries


def to_toml(config: JobConfig) -> str:
    """The whole resolved config as TOML; loading it back gives an equal config."""
    lines = []
    for path, values in config_sections(config):
        lines.append(f"[{'.'.join(path)}]")
        # TOML has no null: an unset optional is written by leaving it out
        lines += [f"{name} = {toml_value(value)}" for name, value in values.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...] [--print-config]"
        " [--dry-run [--world-size N] [--compare-schedules]]",
        "",
        "Settings come from the schema defaults, then the TOML file, then the command line.",
        "Forms: --section.key VALUE, --section.key=VALUE, --section.key / --section.no-key for booleans,",
        "lists as a,b,c or '[\"a\", \"b\"]', nested tables as --training.dataloader.key, free tables as",
        "--model.overrides.n_layers 4. '-' and '_' are interchangeable in key names.",
        "",
        "  --print-config   print the resolved config as TOML and exit",
        "  --dry-run        print the parallel plan (mesh, stages, memory, bubble) without training",
        "  --world-size N   ranks to plan for with --dry-run (default: WORLD_SIZE, else the degrees' product)",
        "  --compare-schedules  with --dry-run: the pipeline's predicted step under every schedule, each with its",
        "                   planned split",
        "",
    ]
    for path, fields in walk_sections(JobConfig):
        lines.append(f"[{'.'.join(path)}]")
        for name, spec in fields.items():
            flag = "--" + ".".join(path + (name,))
            lines.append(f"  {flag}  {spec.type_name()}  (default: {default_text(spec)})")
            lines.append(f"      {spec.doc}")
        lines.append("")
    return "\n".join(lines)
