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
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = ", ".join(str(r) for r in sorted(e.failures))
        print(f"error: rank(s) {ranks} exited with status {', '.join(map(str, codes))}; see their output above",
              file=sys.stderr)
        # torchrun stops the other ranks (SIGTERM, status -15) once one fails: 2 from any rank
        # means a user error was reported.
        return 2 if 2 in codes else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
