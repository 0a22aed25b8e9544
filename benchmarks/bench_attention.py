"""Causal grouped-query attention, forward + backward, by implementation: why the model calls SDPA.

    python benchmarks/bench_attention.py                      # the debug model's shape
    python benchmarks/bench_attention.py --heads 12 --kv-heads 4 --head-dim 64 --batch 2

Compares torch's fused kernel (what `Attention` calls), the same kernel with contiguous inputs
instead of transposed views, SDPA's math backend, and a hand-written matmul + masked softmax.
Prints the median time of `--repeats` runs and the rate on the causal work the kernel does.
"""

import argparse
import statistics
import time

from arguments import at_least  # benchmarks/arguments.py, beside this script

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def math_backend(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return fused(q, k, v)


def by_hand(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seq = q.shape[2]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def timed(fn, make, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        q, k, v = make()
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--seq", type=at_least(1), default=256)
    parser.add_argument("--heads", type=at_least(1), default=16)
    parser.add_argument("--kv-heads", type=at_least(1), default=8)
    parser.add_argument("--head-dim", type=at_least(1), default=16)
    parser.add_argument("--repeats", type=at_least(1), default=20)
    a = parser.parse_args()
    b, s, h, kv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim

    def transposed():  # as the model passes them: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
        return [torch.randn(b, s, n, d, requires_grad=True).transpose(1, 2) for n in (h, kv, kv)]

    def contiguous():
        return [torch.randn(b, n, s, d, requires_grad=True) for n in (h, kv, kv)]

    # causal QK^T and AV forward (2 matmuls x 2 FLOPs x half the scores), backward twice that
    flops = 3 * 4 * b * h * s * s * d / 2
    print(f"shape (batch {b}, heads {h}/{kv} kv, seq {s}, head_dim {d}), {torch.get_num_threads()} threads")
    print("| implementation | fwd + bwd (ms) | GFLOP/s on the causal work |")
    print("|---|---:|---:|")
    for name, fn, make in [("SDPA fused, transposed views (the model)", fused, transposed),
                           ("SDPA fused, contiguous", fused, contiguous),
                           ("SDPA math backend", math_backend, transposed),
                           ("matmul + masked softmax", by_hand, transposed)]:
        t = timed(fn, make, a.repeats)
        print(f"| {name} | {t * 1e3:.1f} | {flops / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
