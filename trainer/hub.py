"""Hugging Face Hub ids where a model folder is expected (``[checkpoint] initial_load_path``, ``convert from-hf``):
``meta-llama/Llama-3.2-1B`` is downloaded once into the Hugging Face cache with ``huggingface_hub`` (config,
safetensors and tokenizer files only) and read from there; without a network or access it is one line saying what
to do. With ``HF_HUB_OFFLINE=1`` a model already in the cache (a local mirror) is used without asking the Hub."""

import logging
from pathlib import Path

from trainer.config.validate import is_hub_id
from trainer.errors import UserError

__all__ = ["hub_folder", "is_hub_id"]
logger = logging.getLogger(__name__)
PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken"]


def hub_folder(repo_id: str, key: str) -> Path:
    """The local folder of the Hub model ``repo_id`` (downloaded if the cache lacks it); one UserError naming
    ``key`` where it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError:  # installed with datasets and transformers; a stripped environment may lack it
        raise UserError(f"{key}: {repo_id} is not a folder here, and huggingface_hub (to download it from the Hub)"
                        " is not installed; pip install huggingface_hub, or give a local folder") from None
    fix = (f"download it where the Hub can be reached (huggingface-cli download {repo_id} --local-dir DIR) and give"
           " DIR")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=PATTERNS))
    except GatedRepoError:
        raise UserError(f"{key}: {repo_id} is gated on the Hugging Face Hub: accept its terms there and log in"
                        " (huggingface-cli login, or HF_TOKEN), or " + fix) from None
    except RepositoryNotFoundError:
        raise UserError(f"{key}: {repo_id} is neither a folder here nor a model on the Hugging Face Hub (or it is"
                        " private: log in with huggingface-cli login, or set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise UserError(f"{key}: {repo_id} is not a folder here, not in the Hugging Face cache, and the Hub cannot be"
                        " reached (no network, or HF_HUB_OFFLINE is set); " + fix) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{key}: cannot download {repo_id} from the Hugging Face Hub ({first[:200]}); " + fix) from None
    logger.info("%s: %s from the Hugging Face cache at %s", key, repo_id, folder)
    return folder
