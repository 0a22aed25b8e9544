"""Generation speed with and without the KV cache, by prompt length (trainer/generate.py).

    python benchmarks/bench_generate.py [--flavors debugmodel 270M] [--prompts 16 512] [--new 64] [--repeats 3]

For each flavor of the llama3 family (random weights, float32, this machine's device) and prompt
length: the seconds to generate ``--new`` tokens greedily (the whole call, prompt included), median
of ``--repeats`` runs, as tokens per second, with and without the cache, and their ratio. Without the
cache every new token recomputes the whole sequence, so its cost grows with the prompt; with it a
token costs one position's forward (plus attention over the cached keys).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from trainer.config.schema import Model  # noqa: E402
from trainer.generate import generate  # noqa: E402
from trainer.models import get_model_spec, resolve_model_args  # noqa: E402
from trainer.models.init import materialize_  # noqa: E402


def build(flavor: str, length: int, device: str):
    spec = get_model_spec("llama3")
    args = spec.with_seq_len(resolve_model_args(spec, Model(flavor=flavor)), length)
    model = spec.meta_model(args)
    materialize_(model, torch.device(device), seed=0)
    return model.eval(), args.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "270M"])
    parser.add_argument("--prompts", nargs="+", type=at_least(1), default=[16, 512])
    parser.add_argument("--new", type=at_least(1), default=64)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = parser.parse_args()
    print(f"device {a.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {a.new} new tokens,"
          f" greedy, median of {a.repeats}\n")
    print("| flavor | prompt tokens | tokens/s, KV cache | tokens/s, no cache | cache / no cache |")
    print("|---|---:|---:|---:|---:|")
    for flavor in a.flavors:
        for length in a.prompts:
            model, vocab = build(flavor, length + a.new, a.device)
            prompt = torch.randint(0, vocab - 2, (length,), generator=torch.Generator().manual_seed(0)).tolist()
            rates = {}
            for cache in (True, False):
                generate(model, prompt, max_new_tokens=2, eos_id=None, kv_cache=cache)  # warm-up
                times = []
                for _ in range(a.repeats):
                    began = time.perf_counter()
                    out = generate(model, prompt, max_new_tokens=a.new, eos_id=None, kv_cache=cache)
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - began)
                assert len(out) == a.new
                rates[cache] = a.new / statistics.median(times)
            print(f"| {flavor} | {length} | {rates[True]:.1f} | {rates[False]:.1f}"
                  f" | {rates[True] / rates[False]:.2f} |")


if __name__ == "__main__":
    main()
