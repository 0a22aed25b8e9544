"""Tokenizers, document sources, token shards and the loaders that read them."""

from trainer.data.build import build_eval_loader, build_train_loader
from trainer.data.loader import WindowLoader, WindowOrder
from trainer.data.shards import TokenShards, prepare_shards
from trainer.data.sources import Source, load_documents
from trainer.data.stream import PackedBatchLoader
from trainer.data.tokenizer import HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "HFTokenizer", "PackedBatchLoader", "Source", "TokenShards", "Tokenizer", "WindowLoader", "WindowOrder",
    "build_eval_loader", "build_tokenizer", "build_train_loader", "load_documents", "prepare_shards",
]
