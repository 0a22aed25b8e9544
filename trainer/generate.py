"""Sample text from a checkpoint or a Hugging Face folder, in one process (CPU or one GPU).

    python -m trainer.generate MODEL --prompt "def fib(n):" [--max-new-tokens 64] [--temperature 0.8]
                               [--top-k 50] [--top-p 0.95] [--seed 0] [--no-kv-cache] [--device cuda]
                               [--logits OUT.pt] [--job.config_file JOB.toml] [--section.key value ...]

MODEL is a DCP step folder this trainer wrote (the job config is the run's ``config.toml``
unless ``--job.config_file`` names one) or a Hugging Face folder (config.json, safetensors and
tokenizer.json). The prompt is encoded with the model's tokenizer after its begin-of-text token;
``--prompt-file`` reads it from a file. Temperature 0 (the default) is greedy decoding. Keys
and values of earlier positions are cached, so each new token costs the same whatever the
prompt's length (``--no-kv-cache`` recomputes the whole sequence per token). Generation stops
at the end-of-text token or after ``--max-new-tokens``. The completion goes to stdout, a line of
timings to stderr. ``--logits OUT.pt`` saves the prompt's logits, (positions, vocabulary) in
float32, to compare with another implementation, and generates nothing.
"""

import sys
import time
from pathlib import Path

from trainer.errors import UserError, one_line

USAGE = ("usage: python -m trainer.generate MODEL (--prompt TEXT | --prompt-file FILE) [--max-new-tokens N]"
         " [--temperature T] [--top-k K] [--top-p P] [--seed S] [--no-kv-cache] [--device DEVICE]"
         " [--dtype DTYPE] [--logits OUT.pt] [--section.key value ...]")


def sample_next(logits, *, temperature: float, top_k: int, top_p: float, generator):
    """The next token id of each row of ``logits`` (batch, vocab): greedy at temperature 0, else sampled from
    the softmax at that temperature over the ``top_k`` most likely tokens and the smallest set whose
    probability reaches ``top_p``."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the ones before it already reach top_p (the most likely one always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def generate(model, prompt: list[int], *, max_new_tokens: int, eos_id: int | None, kv_cache: bool = True,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The ids ``model`` continues ``prompt`` with (without the prompt), up to EOS or one of ``stop_ids``
    (included) or ``max_new_tokens``. The model's rotary table must cover the prompt plus ``max_new_tokens``."""
    import torch

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt], device=device)
    # every attention module that keeps a cache for generation (the decoder's, latent attention's)
    attentions = [m for m in model.modules() if hasattr(m, "make_kv_cache")]
    if kv_cache:
        dtype = next(model.parameters()).dtype
        for m in attentions:
            m.kv_cache = m.make_kv_cache(1, len(prompt) + max_new_tokens, dtype=dtype, device=device)
    out: list[int] = []
    stops = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    try:
        with torch.inference_mode():
            step_input = tokens
            for _ in range(max_new_tokens):
                logits = model(step_input)[:, -1]
                token = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
                out.append(int(token))
                if out[-1] in stops:
                    break
                tokens = torch.cat([tokens, token[:, None]], dim=1)
                step_input = token[:, None] if kv_cache else tokens
    finally:
        for m in attentions:
            m.kv_cache = None
    return out


def load_model(source: Path, rest: list[str], *, seq_len: int, device: str, dtype):
    """trainer.convert's Loaded for a DCP step folder or a Hugging Face folder."""
    from trainer.convert import load_checkpoint, load_hf
    from trainer.hf import is_hf_folder

    key = "generate MODEL"
    if is_hf_folder(source):
        if rest:
            raise UserError(f"{key}: {source} is a Hugging Face folder, which its config.json describes; drop"
                            f" {' '.join(rest)}")
        loaded = load_hf(source, key=key, seq_len=seq_len, device=device, dtype=dtype)
        if loaded.tokenizer is None:
            raise UserError(f"{key}: {source} has no tokenizer.json, so a prompt cannot be encoded")
        return loaded
    return load_checkpoint(source, rest, key=key, seq_len=seq_len, device=device, dtype=dtype)


def run(argv: list[str]) -> int:
    from trainer.log import init_config_logging

    init_config_logging()
    from trainer.convert import CommandParser, command_device, help_or_usage, report

    if (status := help_or_usage(argv, __doc__, USAGE)) is not None:
        return status

    parser = CommandParser("python -m trainer.generate", USAGE)
    parser.add_argument("model")
    parser.add_argument("--prompt")
    parser.add_argument("--prompt-file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kv-cache", action="store_true")
    parser.add_argument("--device", default="")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--logits")
    try:
        known, rest = parser.parse_known_args(argv)
        if flags := [a for a in rest if a.split("=")[0].startswith(("--compile.", "--dry-run", "--print-config"))]:
            raise UserError(f"{flags[0]}: generate runs the model eagerly in this process and takes no such flag;"
                            " drop it")
        text = _prompt(known)
        _check(known)
        import torch

        from trainer.dtypes import torch_dtype

        device = command_device(known.device, ("cpu", "cuda", "xpu", "mps"), "use cpu, cuda, cuda:N (or xpu, mps)")
        began = time.monotonic()
        # The rotary table covers the longest the prompt can be: a token holds at least one byte of text
        # (the tokenizer comes with the model), plus begin-of-text.
        longest = len(text.encode("utf-8")) + 2 + known.max_new_tokens
        loaded = load_model(Path(known.model), rest, seq_len=longest, device=device, dtype=torch_dtype(known.dtype))
        tok = loaded.tokenizer
        vocab = loaded.spec.vocab_size(loaded.args)
        if tok.vocab_size > vocab:
            raise UserError(f"generate MODEL: its tokenizer has {tok.vocab_size:,} tokens and the model's vocabulary"
                            f" {vocab:,}: the ids past {vocab - 1:,} have no embedding")
        prompt = tok.encode(text, bos=tok.bos_id is not None)
        if not prompt:
            raise UserError("--prompt: the prompt encodes to no tokens (and the tokenizer has no begin-of-text token)")
        new = 0 if known.logits else known.max_new_tokens  # --logits generates nothing
        if loaded.context is not None and len(prompt) + new > loaded.context[0]:
            what = "--prompt-file" if known.prompt_file else "--prompt"
            raise UserError(f"{what}{'' if known.logits else ' and --max-new-tokens'}: the prompt's {len(prompt):,}"
                            f" tokens and {new:,} new ones make {len(prompt) + new:,} positions, past the model's"
                            f" context of {loaded.context[0]:,} ({loaded.context[1]}); shorten the prompt"
                            + ("" if known.logits else " or ask for fewer tokens"))
        loaded_s = time.monotonic() - began
        if known.logits:
            with torch.inference_mode():
                logits = loaded.model(torch.tensor([prompt], device=device))[0].float().cpu()
            try:
                torch.save(logits, known.logits)
            except (OSError, RuntimeError) as e:  # a missing folder, a folder named as the file
                raise UserError(f"--logits {known.logits}: cannot write it ({one_line(e)[:200]})") from None
            print(f"saved the logits of {len(prompt)} prompt tokens, shape {tuple(logits.shape)}, to {known.logits};"
                  f" last position's top token {int(logits[-1].argmax())}", file=sys.stderr)
            return 0
        began = time.monotonic()
        try:
            ids = generate(loaded.model, prompt, max_new_tokens=known.max_new_tokens, eos_id=tok.eos_id,
                           kv_cache=not known.no_kv_cache, temperature=known.temperature, top_k=known.top_k,
                           top_p=known.top_p, seed=known.seed, stop_ids=loaded.stop_ids)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            if not isinstance(e, MemoryError) and "alloc" not in str(e).lower():
                raise
            raise UserError(f"--max-new-tokens {known.max_new_tokens}: not enough memory on {device} for the prompt"
                            f" and the new tokens' cache ({one_line(e)[:160]})") from None
        seconds = time.monotonic() - began
    except UserError as e:
        return report(e, USAGE)
    stopped = bool(ids) and (ids[-1] == tok.eos_id or ids[-1] in loaded.stop_ids)
    print(text + tok.decode(ids[:-1] if stopped else ids))
    stop = "end of text" if stopped else "max_new_tokens"
    print(f"{len(ids)} tokens in {seconds:.2f} s ({len(ids) / max(seconds, 1e-9):.1f} tokens/s; prompt {len(prompt)}"
          f" tokens; stopped at {stop}; KV cache {'off' if known.no_kv_cache else 'on'}; {device}; model loaded in"
          f" {loaded_s:.1f} s)", file=sys.stderr)
    return 0


def _prompt(known) -> str:
    if (known.prompt is None) == (known.prompt_file is None):
        raise UserError("give the prompt with --prompt TEXT or --prompt-file FILE (one of them)")
    if known.prompt is not None:
        return known.prompt
    try:
        return Path(known.prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompt-file {known.prompt_file}: cannot read it ({type(e).__name__}: {e})") from None


MAX_NEW_TOKENS = 2**20


def _check(known) -> None:
    if not 1 <= known.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens {known.max_new_tokens}: must be in 1 .. {MAX_NEW_TOKENS}")
    if not (known.temperature == 0 or 0.01 <= known.temperature <= 100):
        raise UserError(f"--temperature {known.temperature}: must be 0 (greedy) or in 0.01 .. 100")
    if not 0 <= known.seed < 2**63:
        raise UserError(f"--seed {known.seed}: must be in 0 .. 2**63 - 1")
    if known.top_k < 0:
        raise UserError(f"--top-k {known.top_k}: must be >= 0 (0 = all tokens)")
    if not 0 < known.top_p <= 1:
        raise UserError(f"--top-p {known.top_p}: must be in (0, 1]")


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
