"""Introspection of the schema: what each key accepts, its default and its doc.

Everything that reads the schema (TOML loading, CLI parsing, ``--help``, the generated
reference, the resolved-config writer) goes through ``section_fields`` so they cannot
disagree about a key.
"""

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from trainer.config.schema import Range, TableEntries
from trainer.errors import ConfigError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True)
class FieldSpec:
    """How one key is typed, checked and documented."""

    name: str
    kind: Literal["int", "float", "bool", "str", "list", "dict", "section"]
    doc: str
    default: Any
    optional: bool = False
    choices: tuple[str, ...] | None = None
    elem: str | None = None  # element kind of a list: "int" or "str"
    range: Range | None = None
    section: type | None = None  # dataclass of a nested table
    table_entries: bool = False  # a dict whose entries may be tables of single values

    def type_name(self) -> str:
        if self.kind == "list":
            name = f"list[{self.elem}]"
        elif self.choices:
            name = "|".join(self.choices)
        else:
            name = self.kind
        return name + (" (optional)" if self.optional else "")

    def accepted(self) -> str:
        """Words for what this key accepts, used in error messages."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        text = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
            "list": f"a list of {self.elem}s",
            "dict": "a table",
        }[self.kind]
        if self.range is not None:
            text += " " + self.range.describe()
        return text


def _attribute_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal written right under it in the class body."""
    found = _module_class_bodies(cls.__module__).get(cls.__qualname__)
    return _body_docs(found if found is not None else ast.parse(inspect.getsource(cls)).body[0].body)


@functools.cache
def _module_class_bodies(module: str) -> dict[str, list]:
    """Top-level class bodies of a module, parsed once (inspect.getsource parses the whole module
    for every class it is asked for: 16 sections cost ~0.07 s of every start)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (KeyError, OSError, TypeError):
        return {}
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


def _body_docs(body: list) -> dict[str, str]:
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _spec(name: str, hint: Any, default: Any, doc: str) -> FieldSpec:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"unsupported union for {name}"
        hint, optional = args[0], True
    rng, extras = None, []
    if typing.get_origin(hint) is Annotated:
        hint, *extras = typing.get_args(hint)
        rng = next((e for e in extras if isinstance(e, Range)), None)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return FieldSpec(name, "str", doc, default, optional, choices=typing.get_args(hint))
    if origin is list:
        (elem,) = typing.get_args(hint)
        return FieldSpec(name, "list", doc, default, optional, elem=elem.__name__)
    if hint is dict or origin is dict:
        tables = any(isinstance(e, TableEntries) for e in extras)
        return FieldSpec(name, "dict", doc, default, optional, table_entries=tables)
    if dataclasses.is_dataclass(hint):
        return FieldSpec(name, "section", doc, default, optional, section=hint)
    kind = hint.__name__
    assert kind in ("int", "float", "bool", "str"), f"unsupported type for {name}: {hint}"
    return FieldSpec(name, kind, doc, default, optional, range=rng)


@functools.cache
def section_fields(cls: type) -> dict[str, FieldSpec]:
    """Ordered specs of every field of a section dataclass."""
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = _attribute_docs(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        specs[f.name] = _spec(f.name, hints[f.name], default, docs.get(f.name, ""))
    return specs


def _check_range(spec: FieldSpec, value: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"got {value}, expected a finite number")
    if spec.range is not None and not spec.range.accepts(value):
        raise ConfigError(f"got {value!r}, expected {spec.accepted()}")


def _match_choice(spec: FieldSpec, value: str) -> str:
    for choice in spec.choices:
        if value.lower() == choice.lower():
            return choice
    close = difflib.get_close_matches(value.lower(), [c.lower() for c in spec.choices], n=1)
    hint = next((f"; did you mean '{c}'?" for c in spec.choices if close and c.lower() == close[0]), "")
    raise ConfigError(f"got {value!r}, expected {spec.accepted()}{hint}")


def check_value(spec: FieldSpec, value: Any) -> Any:
    """Validate a value parsed from TOML (already typed) and return its canonical form.

    Raises ConfigError with a message that lacks the key path; the caller adds it.
    """
    def wrong():
        return ConfigError(f"got {value!r} ({_toml_type(value)}), expected {spec.accepted()}")

    kind = spec.kind
    if kind == "bool":
        if not isinstance(value, bool):
            raise wrong()
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        _check_range(spec, value)
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        _check_range(spec, float(value))
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise wrong()
        _check_text(value)
        return _match_choice(spec, value) if spec.choices else value
    if kind == "list":
        if not isinstance(value, list):
            raise wrong()
        elem_type = int if spec.elem == "int" else str
        for item in value:
            if isinstance(item, bool) or not isinstance(item, elem_type):
                raise ConfigError(f"list item {item!r} is not a {spec.elem}; expected {spec.accepted()}")
        return list(value)
    if kind == "dict":
        if not isinstance(value, dict):
            raise wrong()
        for k, v in value.items():
            if spec.table_entries and isinstance(v, dict):
                inner = v.values()
            else:
                inner = [v]
            if any(isinstance(x, (dict, list)) or x is None for x in inner):
                what = "a single number, string or boolean" + (", or a table of them" if spec.table_entries else "")
                raise ConfigError(f"entry {k!r} = {v!r} must be {what}")
        return dict(value)
    raise wrong()


def _check_text(text: str) -> None:
    if "\0" in text:
        raise ConfigError(f"got {text!r}: a NUL character cannot be part of a name or path")


def parse_cli_value(spec: FieldSpec, text: str) -> Any:
    """Turn a command-line string into the typed value for ``spec``."""
    kind = spec.kind
    if spec.optional and text.lower() in ("none", "null"):
        return None
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"got {text!r}, expected true or false")
    if kind in ("int", "float"):
        try:
            value = int(text) if kind == "int" else float(text)
        except ValueError:
            raise ConfigError(f"got {text!r}, expected {spec.accepted()}") from None
        return check_value(spec, value)
    if kind == "str":
        _check_text(text)
        return _match_choice(spec, text) if spec.choices else text
    if kind == "list":
        stripped = text.strip()
        if stripped.startswith("["):
            return check_value(spec, parse_toml_literal(stripped))
        items = [s.strip() for s in stripped.split(",")] if stripped else []
        if "" in items:
            raise ConfigError(f"got {text!r}: an empty entry in a comma-separated list")
        if spec.elem == "int":
            try:
                return [int(s) for s in items]
            except ValueError:
                raise ConfigError(f"got {text!r}, expected {spec.accepted()} (comma-separated)") from None
        return items
    raise ConfigError("cannot be set as a whole from the command line; set its entries as keys")


def parse_toml_literal(text: str) -> Any:
    """Parse a TOML value written on the command line (e.g. '["a", "b"]' or '4')."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"got {text!r}, which is not a valid TOML value ({e})") from None


def _toml_type(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(value), type(value).__name__)
