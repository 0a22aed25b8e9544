"""Model families and their registry."""

from trainer.models import deepseek, gemma, gpt_oss, granite, llama, mistral, mixtral, moe, olmo, qwen  # noqa: E402,F401  (register the built-in families)
from trainer.models.registry import (ModelSpec, get_model_spec, import_model_modules, model_blocks, register_model,
                                     resolve_model_args)

__all__ = ["ModelSpec", "get_model_spec", "import_model_modules", "model_blocks", "register_model",
           "resolve_model_args"]
