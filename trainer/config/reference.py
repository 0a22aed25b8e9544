"""Generates docs/config_reference.md from the schema: ``python -m trainer.config.reference``."""

from trainer.config.render import default_text, walk_sections
from trainer.config.schema import JobConfig


def reference_markdown() -> str:
    """docs/config_reference.md, generated from the schema (tests keep the file in sync)."""
    lines = [
        "# Config reference",
        "",
        "Generated from `trainer/config/schema.py` by `python -m trainer.config.reference`; do not edit by hand.",
        "Every key can be set in a TOML job file under its `[section]` or on the command line as",
        "`--section.key value` (see [config.md](config.md)).",
        "",
    ]
    for path, fields in walk_sections(JobConfig):
        lines += [f"## `[{'.'.join(path)}]`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, spec in fields.items():
            type_name = spec.type_name().replace("|", "\\|")
            default = default_text(spec).replace("|", "\\|")
            lines.append(f"| `{name}` | {type_name} | `{default}` | {spec.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
