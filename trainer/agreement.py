"""Every rank must run the same job: checked at start, before any rank builds a mesh or a stage.

Each rank loads the config and plans the job on its own (``build_job_plan``), and a launch over many nodes
can give ranks different inputs at the same path: another TOML file, another command line, another
``pipeline_parallel_cost_file``. Ranks that plan different splits build stages that leave blocks out (on the
same shapes nothing fails: the job trains a smaller model) or that do not fit together; ranks that disagree on
a key such as ``[training] steps`` fail later, in a collective. So once the process group is up, ranks compare
a digest of what decides their share: every config key (but the data and tokenizer paths, whose contents are
compared once open) and the contents of the files the plan read (``trainer.config.render.config_fingerprint``),
and the split the plan chose. Where the digests differ, they exchange the entries and every rank stops with the
same line, naming the first entry that differs, the ranks that differ from rank 0 and both values
(``first_disagreement``); a split planned within another device's memory is named as such (``MEMORY_ENTRY``).
The datasets are compared the same way once they are open (``check_same_data``).
"""

import hashlib
import json

import torch
import torch.distributed as dist

from trainer.errors import UserError

SPLIT_ENTRY = "the planned split"
# A value longer than this is shortened in the message (a list of 63 split points, a digest).
SHOWN = 96


MEMORY_ENTRY = "memory limit"
"""Context of a split: the bytes the split search let each rank hold (``trainer.pipeline.cost.split_memory_limit``)."""


def first_disagreement(everyone: list[dict[str, str]], contexts: list[dict[str, str]] | None = None) -> str | None:
    """The line every rank stops with, or None when all ranks' entries are equal: the first of rank 0's entries
    (in its order; then any entry only other ranks have) on which some rank differs, which ranks, and both values.
    ``contexts``: what else each rank planned with, not compared but named as the cause of another split (each
    rank's memory limit, ``MEMORY_ENTRY``, where it is its own device's)."""
    mine = everyone[0]
    limits = [c.get(MEMORY_ENTRY) for c in contexts or []]
    keys = list(mine) + [k for entries in everyone[1:] for k in entries if k not in mine]
    for key in dict.fromkeys(keys):
        ranks = [r for r, entries in enumerate(everyone) if entries.get(key) != mine.get(key)]
        if not ranks:
            continue
        theirs = everyone[ranks[0]].get(key, "missing")
        ours = mine.get(key, "missing")
        if key == SPLIT_ENTRY and limits and limits[ranks[0]] != limits[0]:
            return (f"[parallelism] pipeline_parallel_memory_limit_gib: ranks {ranks} planned the split"
                    f" {_short(theirs)} within their device's memory of {limits[ranks[0]]} where rank 0 planned"
                    f" {_short(ours)} within {limits[0]} (0 = each rank's own device); set it to the smallest"
                    " device's to plan alike")
        if key == SPLIT_ENTRY:
            return (f"[parallelism] pipeline_parallel_split_points: ranks {ranks} planned the split {_short(theirs)}"
                    " from the same config and files as rank 0 (another trainer or torch version on their nodes?);"
                    f" every rank must plan alike: pipeline_parallel_split_points = {ours} runs rank 0's split on all")
        where = " (different files at the same path on different nodes?)" if "(contents of" in key else (
            " (another config file or command line on their nodes?)")
        return (f"{key}: ranks {ranks} have {_short(theirs)} where rank 0 has {_short(ours)}{where};"
                " every rank must run the same job")
    return None


def _short(value: str) -> str:
    return value if len(value) <= SHOWN else value[:SHOWN - 3] + "..."


def differing_ranks(text: str, device: torch.device) -> list[int]:
    """Ranks whose digest of ``text`` differs from rank 0's (one all-gather of 8 bytes a rank)."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.long, device=device)
    everyone = torch.empty(dist.get_world_size(), dtype=torch.long, device=device)
    # all_gather_single where torch has it (2.13 deprecates all_gather_into_tensor for it)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(everyone, mine)
    values = everyone.tolist()
    return [r for r, d in enumerate(values) if d != values[0]]


def check_same_job(entries: dict[str, str], split_points: list[str] | None, device: torch.device,
                   context: dict[str, str] | None = None) -> None:
    """Stop every rank with one line if any rank's ``entries`` (``trainer.config.render.config_fingerprint``: the
    config and the contents of the plan's files) or planned split differ from rank 0's. ``context``: exchanged
    only then, to name the cause (``first_disagreement``)."""
    if not dist.is_initialized():
        return
    if split_points is not None:
        entries = {**entries, SPLIT_ENTRY: json.dumps(split_points)}
    if not differing_ranks(repr(sorted(entries.items())), device):
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (entries, context or {}))
    message = first_disagreement([e for e, _ in everyone], [c for _, c in everyone])
    if message is not None:  # unequal digests come from unequal entries; None only if they are equal after all
        raise UserError(message)


def check_same_data(device: torch.device, fingerprint: str) -> None:
    """Every rank must have opened the same datasets with the same tokenizer (TP/PP/CP peers read the same
    windows; data-parallel ranks read slices of one global order): compare a digest of what each opened."""
    if not dist.is_initialized():
        return
    differ = differing_ranks(fingerprint, device)
    if differ:
        raise UserError(f"[training] dataset: ranks {differ} opened other data or another tokenizer than rank 0"
                        " (different files at the same path on different nodes?); every rank must see the same")
