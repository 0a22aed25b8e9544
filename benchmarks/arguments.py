"""Argument types the benchmark scripts share (each script runs with this folder on sys.path)."""

import argparse


def at_least(minimum: int):
    """An argparse type: a whole number of at least ``minimum``. Anything else is one line naming the option,
    exit 2, before anything runs (not a traceback after minutes of runs)."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: at least {minimum}")
        return value

    count.minimum = minimum
    return count


def check_timed_steps(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--steps`` must leave a step to time after ``--warmup``: one line naming both, exit 2."""
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps}: more than --warmup {args.warmup} (the steps after it are timed)")
