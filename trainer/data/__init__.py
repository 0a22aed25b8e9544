"""Tokenizer, document sources and the packing data loader."""

from trainer.data.loader import PackedBatchLoader
from trainer.data.sources import load_documents
from trainer.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["PackedBatchLoader", "Tokenizer", "build_tokenizer", "load_documents"]
