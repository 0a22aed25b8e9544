"""Tied (shared) parameters: find them, and restore them after steps that break Python identity.

``parallelize_module`` and ``nn.Module.to_empty`` replace each module's parameter on its own,
so two modules that shared one Parameter end up with two. The fix is generic: remember which
names shared a parameter and point them at one object again.
"""

from torch import nn


def find_tied(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that refer to one Parameter object (each group has 2+ names)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie_(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name in each group refer to the first name's parameter again."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)
