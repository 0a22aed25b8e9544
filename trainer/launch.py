"""torchrun without the traceback: ``python -m trainer.launch [torchrun args] train.py ...``.

torchrun raises ChildFailedError (and prints its stack) whenever a worker exits non-zero,
even when the worker already printed a clear one-line user error. This wrapper runs the same
launcher, and on failure prints one line naming the failed ranks and exits with their status.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: list[str]) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        print(f"error: {failure_summary(e.failures)}", file=sys.stderr)
        # torchrun stops the other ranks (SIGTERM, status -15) once one fails: 2 from any rank
        # means a user error was reported.
        return 2 if any(f.exitcode == 2 for f in e.failures.values()) else 1
    return 0


def failure_summary(failures: dict) -> str:
    """One line: the rank that failed first and how, then the others grouped by how they ended.

    ``failures`` maps global rank -> torchrun's ProcessFailure (exitcode, timestamp)."""
    # The launcher's own SIGTERM is a consequence of another failure; among the rest, the earliest
    # (torchrun's timestamps are whole seconds, so ties fall to the lower rank).
    first = min(failures, key=lambda r: (failures[r].exitcode == -15, failures[r].timestamp, r))
    line = f"rank {first} failed first ({_how(failures[first].exitcode)})"
    by_code: dict[int, list[int]] = {}
    for rank in sorted(failures):
        if rank != first:
            by_code.setdefault(failures[rank].exitcode, []).append(rank)
    for code, ranks in sorted(by_code.items()):
        line += f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {_how(code)}"
    return line + f"; see rank {first}'s output above"


def _how(code: int) -> str:
    signals = {-15: "stopped by the launcher (SIGTERM)", -9: "killed (SIGKILL)", -6: "aborted (SIGABRT)",
               -11: "crashed (SIGSEGV)"}
    return signals.get(code, f"signal {-code}") if code < 0 else f"exit status {code}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
