"""Tokenize a dataset into token shards, once, before training.

    python -m trainer.prepare OUTPUT_FOLDER --job.config_file configs/my_job.toml [--section.key value ...]
    python -m trainer.prepare --verify FOLDER      # check every shard file against its recorded sha256

Reads the dataset named by the job's ``[training]`` keys (``dataset``, ``dataset_path``,
``[training.dataloader]`` split/subset/text_column; hub datasets are downloaded, not streamed),
or with ``--validation`` the ``[validation]`` dataset, and tokenizes it with the job's
``[model]`` tokenizer on all cores. Point ``[training] dataset_path`` (or ``[validation]
dataset_path``) at OUTPUT_FOLDER to train on it. Bad input prints one line and exits 2.
"""

import logging
import sys
from dataclasses import replace

from trainer.errors import UserError, one_line

USAGE = ("usage: python -m trainer.prepare OUTPUT_FOLDER [--validation] [--job.config_file FILE] [--section.key"
         " value ...]\n       python -m trainer.prepare --verify FOLDER")


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--verify":
        return _verify(argv[1:])
    out, rest = argv[0], argv[1:]
    validation = "--validation" in rest
    rest = [a for a in rest if a != "--validation"]
    try:
        from trainer.config import load_config
        from trainer.data.shards import iter_texts, prepare_shards
        from trainer.data.sources import Source, load_documents, training_source
        from trainer.data.tokenizer import build_tokenizer
        from trainer.models import get_model_spec, import_model_modules, resolve_model_args

        if out.startswith("--"):
            raise UserError(f"the output folder comes first ({USAGE})")
        config = load_config(overrides=rest)
        import_model_modules(config.model.modules)
        spec = get_model_spec(config.model.name)
        tokenizer = build_tokenizer(config.model, spec.vocab_size(resolve_model_args(spec, config.model)))
        opts = replace(config.training.dataloader, streaming=False)  # the whole dataset, downloaded
        if validation:
            v = config.validation
            source = Source(v.dataset, v.dataset_path, v.split, section="[validation]", split_key="[validation] split")
        else:
            source = training_source(config.training)
        docs = load_documents(source, opts)
        summary = prepare_shards(iter_texts(docs, opts.text_column, "[training.dataloader] text_column"), tokenizer,
                                 out, source=source.name)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"prepared {source.name} with {tokenizer.identity} into {out}: {summary['documents']:,} documents,"
          f" {summary['tokens']:,} tokens in {summary['shards']} shard(s), {summary['seconds']:.1f} s"
          f" ({summary['tokens_per_second']:,.0f} tokens/s)")
    return 0


def _verify(folders: list[str]) -> int:
    if len(folders) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    from trainer.data.shards import TokenShards

    try:
        shards = TokenShards(folders[0], key="--verify")
        shards.verify()
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"{folders[0]}: {len(shards.shards)} shard file(s), {shards.num_tokens:,} tokens, every sha256 as prepared")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(run(sys.argv[1:]))
