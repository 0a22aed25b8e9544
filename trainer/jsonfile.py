"""Every JSON file the project reads from a user (Hugging Face config, index, tokenizer and generation files, cost
files, shard indexes, checksum manifests) goes through ``read_json``: an unreadable, malformed, too deeply nested or
wrongly shaped file is one ``UserError`` naming the key (or argument) that led to it, the file and, for an entry,
the entry, never a traceback."""

import json
import logging
import math
from pathlib import Path

from trainer.errors import UserError

logger = logging.getLogger(__name__)

MAX_DEPTH = 64  # far deeper than any real config; a hostile file nested 100,000 deep is refused, not recursed into
MAX_BYTES = 1 << 30  # index and manifest files are kilobytes to megabytes


def _depth(text: str) -> int:
    """The deepest nesting of brackets outside strings (a scan, not a recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def read_json(path: Path, key: str, *, expect: type = dict, what: str = "JSON file"):
    """The parsed content of ``path`` (of type ``expect``); ``key`` names the setting or argument in the error."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise UserError(f"{key}: {path} is {size:,} bytes, not a {what} (at most {MAX_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{key}: {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {path} is not a {what} (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{key}: cannot read {path} ({e.strerror or e})") from None
    if (depth := _depth(text)) > MAX_DEPTH:
        raise UserError(f"{key}: {path} is not a {what} (nested {depth} deep; at most {MAX_DEPTH})")
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError, and an integer too long for Python's int parser
        raise UserError(f"{key}: {path} is not a {what} (malformed JSON: {e})") from None
    if not isinstance(data, expect):
        wanted = _kind(expect())
        raise UserError(f"{key}: {path} is not a {what} (a JSON {_kind(data)}, where"
                        f" {'an' if wanted[0] in 'aeiou' else 'a'} {wanted} is expected)")
    return data


def _kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def entry(data: dict, name: str, types: type | tuple, path: Path, key: str, *, required: bool = True,
          finite: bool = True, where: str = ""):
    """``data[name]`` checked to be of ``types`` (and, for a number, finite); a missing or wrong entry is one
    UserError naming the file and the entry (``where``: its place in the file, e.g. ``fit.F.pre_s``)."""
    where = where or name
    if name not in data:
        if required:
            raise UserError(f"{key}: {path} has no {where!r}")
        return None
    value = data[name]
    bad_bool = isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    if not isinstance(value, types) or bad_bool:
        wanted = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise UserError(f"{key}: {path} {where} = {value!r}: expected {wanted}")
    if finite and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key}: {path} {where} = {value!r}: must be a finite number")
    return value


def say_unknown(data: dict, known, path: Path, key: str, *, where: str = "") -> None:
    """One warning naming the entries of ``data`` (at ``where`` in the file) that the reader does not know:
    read by a newer version of the project, or misspelt, they are not used."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        at = f" in {where}" if where else ""
        logger.warning("%s: %s has entries%s that are not read: %s", key, path, at, ", ".join(map(repr, unknown)))


def count(data: dict, name: str, path: Path, key: str, *, where: str = "", most: int = 1 << 62) -> int:
    """``data[name]``, a whole number in [0, most]."""
    value = entry(data, name, int, path, key, where=where or name)
    if not 0 <= value <= most:
        raise UserError(f"{key}: {path} {where or name} = {value!r}: must be between 0 and {most:,}")
    return value


def file_name(data: dict, name: str, path: Path, key: str, *, where: str = "") -> str:
    """``data[name]``, the plain name of a file beside ``path`` (no folder, no parent, no NUL byte)."""
    value = entry(data, name, str, path, key, where=where or name)
    if not value or "/" in value or "\\" in value or "\0" in value or value in (".", ".."):
        raise UserError(f"{key}: {path} {where or name} = {value!r}: must be the name of a file in its folder")
    return value
