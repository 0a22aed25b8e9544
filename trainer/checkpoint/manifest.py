"""Checksum manifests: ``checksums.json`` (size and sha256 of every file of a checkpoint folder), written
at save and checked before loading by every rank, each hashing a share of the files."""

import hashlib
import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.errors import UserError
from trainer.jsonfile import count, entry, file_name, read_json, say_unknown

logger = logging.getLogger(__package__)

MANIFEST = "checksums.json"
_PART = re.compile(r"^checksums\.rank\d+\.json$")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_share(folder: Path) -> None:
    """Hash this rank's share of the files in ``folder`` into ``checksums.rank<R>.json`` (no collectives:
    safe in a background thread). Every rank lists the same folder, so the shares cover every file."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST and not _PART.match(p.name))
    mine = {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
            for name in names[rank()::world()]}
    (folder / f"checksums.rank{rank()}.json").write_text(json.dumps(mine))


def merge_shares(folder: Path) -> None:
    """Rank 0, once every rank has hashed its share: one ``checksums.json`` for the folder. A file no
    share covers (a rank's listing lagging behind on a network file system) is hashed here."""
    files = {}
    for part in sorted(p for p in folder.iterdir() if _PART.match(p.name)):
        files.update(json.loads(part.read_text()))
        part.unlink()
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST and path.name not in files:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (folder / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1))


def find_damage(folder: Path) -> str | None:
    """What is wrong with ``folder`` by its ``checksums.json`` (None: intact, or saved without checksums).
    Every rank checks a share of the files; the verdicts are combined, so every rank returns the same."""
    names, expected, problem, reason = [], [], 0, ""  # problem: 0 none, 1 no manifest, 2 unreadable manifest
    if not (folder / MANIFEST).exists():
        problem = 1
    else:
        try:
            files = read_manifest(folder / MANIFEST)
            names, expected = sorted(files), [files[n] for n in sorted(files)]
        except UserError as e:
            problem, reason = 2, " (" + str(e).split(f"{folder / MANIFEST} ", 1)[-1] + ")"
    # Every rank must take the same branch before the per-file verdicts are combined: agree on what
    # each read (the worst problem, and the number of files: the same manifest gives the same count).
    seen = torch.tensor([problem, len(names), -len(names)], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    problem, most, fewest = int(seen[0]), int(seen[1]), -int(seen[2])
    if problem == 1:
        if not (folder / ".metadata").is_file():  # no checksums and no metadata: nothing there to load
            return "its .metadata is missing (the folder was emptied, or the save never completed)"
        logger.warning("checkpoint %s has no %s (saved without [checkpoint] verify, or the file was lost):"
                       " loading it unverified", folder, MANIFEST)
        return None
    if problem == 2 or most != fewest:
        return f"its {MANIFEST} is unreadable" + (reason if problem == 2 else " (ranks read different contents)")
    # 0 = intact, 1 = missing, 2 = wrong size, 3 = wrong contents; combined with MAX over ranks (CPU: gloo)
    verdicts = torch.zeros(len(names), dtype=torch.int32)
    for i in range(rank(), len(names), world()):
        path = folder / names[i]
        if not path.is_file():
            verdicts[i] = 1
        elif path.stat().st_size != expected[i][0]:
            verdicts[i] = 2
        elif _sha256(path) != expected[i][1]:
            verdicts[i] = 3
    if dist.is_initialized():
        dist.all_reduce(verdicts, op=dist.ReduceOp.MAX)
    bad = [(names[i], int(v)) for i, v in enumerate(verdicts.tolist()) if v]
    if not bad:
        return None
    name, verdict = bad[0]
    size = expected[names.index(name)][0]
    what = {1: "is missing", 2: f"is not the {size} bytes written", 3: "has other contents than written"}
    more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
    return f"{name} {what[verdict]}{more}"


def read_manifest(path: Path) -> dict[str, tuple[int, str]]:
    """{file name: (bytes, sha256)} of a checksum manifest, its every entry checked (UserError otherwise)."""
    key = "checkpoint"
    data = read_json(path, key, what="checksum manifest")
    say_unknown(data, ("algorithm", "files"), path, key)
    if data.get("algorithm", "sha256") != "sha256":
        raise UserError(f"{key}: {path} algorithm = {data['algorithm']!r}: only 'sha256' is written or checked")
    files = {}
    for name, info in entry(data, "files", dict, path, key).items():
        at = f"files[{name!r}]"
        if not isinstance(info, dict):
            raise UserError(f"{key}: {path} {at} = {info!r}: expected an object")
        file_name({"name": name}, "name", path, key, where=f"{at} (the name)")
        say_unknown(info, ("bytes", "sha256"), path, key, where=at)
        files[name] = (count(info, "bytes", path, key, where=f"{at}.bytes"),
                       entry(info, "sha256", str, path, key, where=f"{at}.sha256"))
    return files


def barrier(group=None) -> None:
    """Every rank of ``group`` (default: the whole job) gets here before any goes on."""
    if dist.is_initialized():
        dist.barrier(group=group)
