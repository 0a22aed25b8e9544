"""Command-line entry point: ``python train.py --job.config_file configs/debug_model.toml [--section.key value ...]``.

Parses the config, then calls ``trainer.train.main``. User errors print one line and exit 2.
``--print-config`` and ``--dry-run`` build the job plan too, so they report every error a run
would (``run_train.sh`` has its launcher check the same before starting any process).
"""

import os
import signal
import sys

from trainer.errors import UserError, error_lines, lost_peer

INTERRUPTED = 128 + signal.SIGINT  # run()'s status after Ctrl-C; the process then ends by SIGINT itself


def run(argv: list[str]) -> int:
    from trainer.config import help_text, parse_args, to_toml
    from trainer.log import init_config_logging

    init_config_logging()
    try:
        invocation = parse_args(argv)
        if invocation.action == "help":
            print(help_text())
            return 0
        if invocation.action in ("print-config", "dry-run"):
            from trainer.plan import build_job_plan, degrees_product

            env_world = os.environ.get("WORLD_SIZE", "")
            world_size = invocation.world_size or (int(env_world) if env_world.isdigit() else None)
            # The dry run plans for other machines: no check against this one's memory.
            plan = build_job_plan(invocation.config, world_size or degrees_product(invocation.config),
                                  check_memory=invocation.action == "print-config")
            if invocation.action == "print-config":
                print(to_toml(invocation.config), end="")
            else:
                from trainer.dry_run import compare_schedules, describe_plan

                print(describe_plan(plan), end="")
                if invocation.compare_schedules:
                    print("\n" + "\n".join(compare_schedules(plan, plan.dims.world_size)))
            return 0
        from trainer.train import main

        main(invocation.config)
    except UserError as e:
        for line in error_lines(e):
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C reaches every process of the terminal's group, each rank included: one line each, not a traceback
        rank = os.environ.get("RANK")
        print(f"{f'rank {rank}: ' if rank else ''}interrupted (SIGINT)", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:
        if not lost_peer(e):
            raise
        # A consequence, not a cause: another rank died or hung first. The launcher's summary
        # names it; a traceback from every survivor would bury that line.
        rank = os.environ.get("RANK", "0")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: rank {rank}: lost contact with another rank ({type(e).__name__}: {first[:200]})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from trainer.errors import end_by_signal, stop_once_on_sigint

    stop_once_on_sigint()
    try:
        code = run(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `python train.py --help | head -3`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if code == INTERRUPTED:
        end_by_signal(signal.SIGINT)
    sys.exit(code)
