"""Exceptions for problems the user can fix by changing the config or the inputs.

Anything raised as a ``UserError`` is printed by ``train.py`` as one line (no traceback)
and the process exits with status 2. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem caused by the job's config or input files, with a message naming the fix."""

    def __str__(self) -> str:
        # One line wherever it is shown: a value quoted in the message may hold a newline (seen by the
        # CLI fuzz test with a file name ending in "\n0").
        return one_line(super().__str__())


class ConfigError(UserError, ValueError):
    """The config (TOML file or command line) is malformed or inconsistent."""


class ConfigErrors(ConfigError):
    """Several independent mistakes found in one pass (every unknown key of a file), reported together."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


def error_lines(error: UserError) -> list[str]:
    """How an error is shown: one line per mistake (``ConfigErrors`` holds several)."""
    return [str(e) for e in error.errors] if isinstance(error, ConfigErrors) else [one_line(error)]


def not_found(key: str, path: object, what: str = "file not found") -> "UserError":
    """The error for a file or folder a key names that is not there, naming the absolute path looked for:
    a relative path is resolved against the folder the run was started from, which the user may not expect."""
    import os

    name = os.fspath(path)
    full = os.path.abspath(name)
    shown = repr(name) if name != name.strip() else name  # a trailing space is invisible otherwise
    if what == "file not found" and os.path.isdir(name):
        what = "a folder, not a file"
    return ConfigError(f"{key}: {what}: {shown}" + ("" if full == name else f" (looked for {full})"))


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective or point-to-point failing because a peer died or stopped answering
    (and not a failure of this rank's own, which keeps its traceback)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting"))


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


def one_line(message: object) -> str:
    """``message`` as one printable line: control characters (a newline in a file name, say) escaped."""
    import re

    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], str(message).strip())


def stop_once_on_sigint() -> None:
    """Ctrl-C reaches a rank twice: from the terminal (SIGINT to the whole process group) and from torchrun, which
    passes it on. The first raises ``KeyboardInterrupt`` as usual; later ones are ignored, so that they cannot
    break into the cleanup or the one line that reports the first (``end_by_signal`` ends the process)."""
    import signal

    def interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


def end_by_signal(signum: int) -> None:
    """End this process by ``signum``, with the signal's own action, once it has said why in one line. A calling
    shell then sees a process stopped by the signal (status 128 + signum) and stops too: a loop of runs ends at
    Ctrl-C, where an exit status of 130 would go on to the next run. Threads still running (a loader, a
    checkpoint writer) end with the process instead of holding its exit."""
    import os
    import signal
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # not reached where the signal ends the process
