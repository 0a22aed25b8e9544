"""Every "[section] key" that a message of the package names is a real config key (a renamed key must take its
messages along): string literals are scanned; a word after the section is a key reference when it has an
underscore or is the name of some key (so "[checkpoint] cannot write" is prose, "[training] seq_len" a reference)."""

import ast
import dataclasses
import re
from pathlib import Path

import trainer
from trainer.config.schema import JobConfig
from trainer.models.registry import _REGISTRY

PACKAGE = Path(trainer.__file__).parent
REFERENCE = re.compile(r"\[([a-z_]+(?:\.[a-z_]+)*)\] ([a-z_][a-z0-9_]*)")


def sections() -> dict[str, set[str]]:
    """'training' / 'training.dataloader' -> its keys, for every section of JobConfig."""
    out: dict[str, set[str]] = {}

    def walk(cls, prefix: str) -> None:
        fields = dataclasses.fields(cls)
        out[prefix] = {f.name for f in fields}
        for f in fields:
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                walk(sub, f"{prefix}.{f.name}" if prefix else f.name)

    walk(JobConfig, "")
    # [model.overrides] takes any field of a family's model arguments
    out["model.overrides"] = {f.name for spec in _REGISTRY.values() for args in spec.flavors.values()
                              for f in dataclasses.fields(args)}
    return out


def references() -> list[tuple[str, str, str]]:
    """(section, word, file:line) of every '[section] word' in a string literal of the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for m in REFERENCE.finditer(node.value):
                    found.append((m.group(1), m.group(2), f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"))
    return found


def test_every_section_key_in_a_message_names_a_real_key():
    import trainer.models  # noqa: F401 (registers the built-in families)

    keys = sections()
    every_key = set().union(*keys.values())
    refs = references()
    assert len(refs) > 150  # the scan sees the messages
    bad = []
    for section, word, where in refs:
        if "_" not in word and word not in every_key:
            continue  # prose: "[checkpoint] cannot write ..."
        known = keys.get(section, set())
        if word.endswith("_"):  # a prefix completed at run time ("[parallelism] pipeline_parallel_" + name)
            ok = any(k.startswith(word) for k in known)
        else:
            ok = word in known
        if not ok:
            bad.append(f"{where}: [{section}] {word}")
    assert not bad, "messages naming keys that do not exist:\n" + "\n".join(bad)
