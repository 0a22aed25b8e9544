"""A declarative, TOML-driven trainer for decoder-only language models on torch.distributed."""

__version__ = "0.1.0"
