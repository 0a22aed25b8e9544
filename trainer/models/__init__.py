"""Model families and their registry."""

from trainer.models import llama  # noqa: E402,F401  (registers the built-in family)
from trainer.models.registry import ModelSpec, get_model_spec, import_model_modules, register_model, resolve_model_args

__all__ = ["ModelSpec", "get_model_spec", "import_model_modules", "register_model", "resolve_model_args"]
