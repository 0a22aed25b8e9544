"""Command-line entry point: ``python train.py --job.config_file configs/debug_model.toml [--section.key value ...]``.

Parses the config, then calls ``trainer.train.main``. User errors print one line and exit 2.
"""

import sys

from trainer.errors import UserError


def run(argv: list[str]) -> int:
    from trainer.config import help_text, parse_args, to_toml

    try:
        invocation = parse_args(argv)
        if invocation.action == "help":
            print(help_text())
            return 0
        if invocation.action == "print-config":
            print(to_toml(invocation.config), end="")
            return 0
        if invocation.action == "dry-run":
            from trainer.plan import describe_plan

            print(describe_plan(invocation.config, invocation.world_size or _degrees_product(invocation.config)), end="")
            return 0
        from trainer.train import main

        main(invocation.config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _degrees_product(config) -> int:
    """World size implied by the degrees when none is given (data_parallel_shard_degree -1 counts as 1)."""
    p = config.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return (p.data_parallel_replicate_degree * shard * p.context_parallel_degree * p.tensor_parallel_degree
            * p.pipeline_parallel_degree)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
