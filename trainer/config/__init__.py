"""Job configuration: schema, loading (TOML + command line), validation and rendering."""

from trainer.config.loader import Invocation, load_config, parse_args
from trainer.config.render import help_text, to_toml
from trainer.config.schema import JobConfig
from trainer.config.validate import validate_config

__all__ = ["Invocation", "JobConfig", "help_text", "load_config", "parse_args", "to_toml", "validate_config"]
