"""Text forms of the schema and of a config: --help, the key reference, resolved TOML."""

import json
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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def default_text(spec: FieldSpec) -> str:
    if spec.default is None:
        return "unset"
    return _toml_value(spec.default)


def to_toml(config: JobConfig) -> str:
    """The whole resolved config as TOML; loading it back gives an equal config."""
    lines = []
    for path, fields in walk_sections(JobConfig):
        section = config
        for name in path:
            section = getattr(section, name)
        lines.append(f"[{'.'.join(path)}]")
        for name, spec in fields.items():
            value = getattr(section, name)
            if path + (name,) in _NOT_DUMPED or value is None:
                continue  # TOML has no null: an unset optional is written by leaving it out
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...] [--print-config] [--dry-run [--world-size N]]",
        "",
        "Settings come from the schema defaults, then the TOML file, then the command line.",
        "Forms: --section.key VALUE, --section.key=VALUE, --section.key / --section.no-key for booleans,",
        "lists as a,b,c or '[\"a\", \"b\"]', nested tables as --training.dataloader.key, free tables as",
        "--model.overrides.n_layers 4. '-' and '_' are interchangeable in key names.",
        "",
        "  --print-config   print the resolved config as TOML and exit",
        "  --dry-run        print the parallel plan (mesh, stages, memory, bubble) without training",
        "  --world-size N   ranks to plan for with --dry-run (default: WORLD_SIZE, else the degrees' product)",
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
