"""Exceptions for problems the user can fix by changing the config or the inputs.

Anything raised as a ``UserError`` is printed by ``train.py`` as one line (no traceback)
and the process exits with status 2. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem caused by the job's config or input files, with a message naming the fix."""


class ConfigError(UserError, ValueError):
    """The config (TOML file or command line) is malformed or inconsistent."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""
