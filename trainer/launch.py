"""torchrun without the traceback: ``python -m trainer.launch [--check-config] [torchrun args] train.py ...``.

torchrun raises ChildFailedError (and prints its stack) whenever a worker exits non-zero,
even when the worker already printed a clear one-line user error. This wrapper runs the same
launcher, and on failure prints one line naming the failed ranks and exits with their status.

``--check-config`` (what ``run_train.sh`` passes) first checks train.py's config and job plan in
this process, for the job's world size (nodes x processes per node): a bad key or an impossible
layout is one line and exit 2 before any worker starts, and the check shares the launcher's torch
import instead of paying for a second interpreter.
"""

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: list[str]) -> int:
    """Launch (and first check) the job; a failed rank or a signal ends it with one line, not a traceback."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    # A scheduler's SIGTERM before the ranks start (the config check, the rendezvous) ends the launch as it does
    # once they run, when torchrun's own handler (which raises the same) takes over.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        return _launch(argv)
    except SignalException as e:
        # Ctrl-C (SIGINT) or SIGTERM while the ranks run: torchrun passed it on to them and waited for them to
        # stop. Each rank said where it stopped, or ended without a word (SIGTERM).
        code = int(e.sigval)
    except KeyboardInterrupt:
        # Ctrl-C before the ranks started: torchrun's handlers are not installed yet
        code = int(signal.SIGINT)
    print(f"launcher: stopped by {signal.Signals(code).name}", file=sys.stderr)
    return 128 + code


def _launch(argv: list[str]) -> int:
    check = bool(argv) and argv[0] == "--check-config"
    args = get_args_parser().parse_args(argv[1:] if check else argv)
    if check and (code := check_config(args)):
        return code
    if str(args.nnodes).rpartition(":")[2] not in ("", "1"):
        announce_rendezvous(args)
    scratch = None
    if args.log_dir is None and args.redirects == "0" and not args.local_ranks_filter:
        # torchrun makes a folder under /tmp at each launch and leaves it: empty, or with copies of what --tee
        # (run_train.sh's) already showed on the console. Give it one that goes when the launch ends. With
        # --log-dir, --redirects or a ranks filter its files may be the only copy of some output, and stay.
        scratch = tempfile.TemporaryDirectory(prefix="torchelastic_")
        args.log_dir = scratch.name
    try:
        run(args)
    except ChildFailedError as e:
        print(f"error: {failure_summary(e.failures)}", file=sys.stderr)
        # torchrun stops the other ranks (SIGTERM, status -15) once one fails: 2 from any rank
        # means a user error was reported.
        return 2 if any(f.exitcode == 2 for f in e.failures.values()) else 1
    finally:
        if scratch is not None:
            scratch.cleanup()
    return 0


def announce_rendezvous(args, first: float = 5.0, every: float = 15.0) -> None:
    """Several nodes: while this node waits for the others to join the rendezvous, say so every ``every``
    seconds (the first time after ``first``), and once they have, which node this is. torchrun itself is
    silent for as long as the rendezvous waits (minutes, when a node was never started)."""
    import threading
    import time

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    handler_class = dynamic_rendezvous.DynamicRendezvousHandler
    join = handler_class.next_rendezvous
    nodes = str(args.nnodes).rpartition(":")[2]

    def next_rendezvous(self):
        done, start = threading.Event(), time.monotonic()
        timeout = getattr(getattr(getattr(self, "_settings", None), "timeout", None), "join", None)
        limit = (f" of {timeout.total_seconds():.0f} s (torchrun's rendezvous join_timeout)" if timeout is not None
                 else "")

        def tell():
            wait = first
            while not done.wait(wait):
                print(f"launcher: waiting for all {nodes} nodes to join the rendezvous at {args.rdzv_endpoint} (job id"
                      f" {args.rdzv_id}): {time.monotonic() - start:.0f} s{limit} so far; start the same command on"
                      " every node", file=sys.stderr, flush=True)
                wait = every

        threading.Thread(target=tell, name="rendezvous-announce", daemon=True).start()
        # The join runs in a thread of its own while this (main) thread waits in Python: the join blocks inside
        # the store's C++ calls, where a signal's Python handler would not run until the call returned (Ctrl-C
        # was seen lost for 65 s that way); a wait on an Event is interrupted at once.
        joined: dict = {}

        def joining():
            try:
                joined["info"] = join(self)
            except BaseException as e:  # handed to the main thread, which raises it
                joined["error"] = e
            finally:
                done.set()

        threading.Thread(target=joining, name="rendezvous-join", daemon=True).start()
        while not done.is_set():
            done.wait(1.0)
        if "error" in joined:
            raise joined["error"]
        info = joined["info"]
        rank, world = (info[1], info[2]) if isinstance(info, tuple) else (getattr(info, "rank", "?"),
                                                                            getattr(info, "world_size", "?"))
        print(f"launcher: node {rank} of {world} joined after {time.monotonic() - start:.0f} s; starting"
              f" {args.nproc_per_node} process(es) here", file=sys.stderr, flush=True)
        return info

    handler_class.next_rendezvous = next_rendezvous


def check_config(args) -> int:
    """0 when train.py's arguments make a job that can be planned on nnodes x nproc_per_node ranks;
    otherwise print the one-line error and return 2."""
    import logging

    from trainer.config import parse_args
    from trainer.env import device_type
    from trainer.errors import UserError, error_lines
    from trainer.plan import build_job_plan, degrees_product

    # The config's warnings are printed by the ranks (once, by rank 0, with their label); here they would be
    # a third, unlabelled copy (Python's last-resort handler).
    logging.getLogger().addHandler(logging.NullHandler())
    try:
        invocation = parse_args(args.training_script_args)
        if invocation.action == "train":
            # --nnodes is "N" or "MIN:MAX" (--standalone leaves "1:1"); an elastic range is planned at its max
            nodes, per_node = str(args.nnodes).rpartition(":")[2], str(args.nproc_per_node)
            world = int(nodes) * int(per_node) if nodes.isdigit() and per_node.isdigit() else None
            # Memory is checked against this machine's device only on CPU: asking CUDA here would start
            # it in the launcher; the workers check it when they plan.
            # Errors about the world size speak the launcher's language: the user set NGPU (and NNODES).
            name = (f"NGPU {per_node}" if nodes == "1"
                    else f"NNODES {nodes} x NGPU {per_node} = {world}") if world else ""
            build_job_plan(invocation.config, world or degrees_product(invocation.config),
                           check_memory=device_type() != "cuda", world_name=name)
    except UserError as e:
        for line in error_lines(e):
            print(f"error: {line}", file=sys.stderr)
        return 2
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
    status = main(sys.argv[1:])
    if status > 128:  # stopped by a signal (main's line said which): end by it, as a shell expects
        from trainer.errors import end_by_signal

        end_by_signal(status - 128)
    sys.exit(status)
