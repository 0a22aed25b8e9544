"""What block-causal attention costs: training step time with attn_mask_type = "causal" and "block_causal".

    python benchmarks/bench_documents.py [--cases debugmodel 270M debugmodel-2k] [--steps 10] [--repeats 2]

For each model case and dataset (the bundled documents, ~2,150 tokens each, where some windows cross a
boundary; and tests/fixtures/short_documents.txt, ~90 tokens each, where nearly every window does), the
median step time of causal attention and of block-causal attention with each backend (sdpa: one masked
kernel call; varlen: the causal kernel once per document), run alternately (in reverse order on every
other repeat) ``--repeats`` times in one sitting, and their ratios to causal (median over the repeats). One
process, float32, this machine's threads. The share of the measured steps' microbatches that held a boundary
(the others run the causal kernel under every variant) and the sdpa backend's mask size are printed too.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from arguments import at_least, check_timed_steps  # benchmarks/arguments.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import trainer.data.documents as documents  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import main  # noqa: E402

CASES = {
    "debugmodel": ["--model.flavor", "debugmodel", "--training.local_batch_size", "8", "--training.seq_len", "256"],
    "270M": ["--model.flavor", "270M", "--training.local_batch_size", "2", "--training.seq_len", "512"],
    "debugmodel-2k": ["--model.flavor", "debugmodel", "--training.local_batch_size", "2", "--training.seq_len", "2048"],
}


def mask_mib(case: str) -> float:
    """The additive mask of one microbatch in float32 (batch x seq x seq values), in MiB: built once per forward
    and kept once per pipeline stage for backward (the sdpa backend; varlen builds none)."""
    args = CASES[case]
    batch, seq = (int(args[args.index(k) + 1]) for k in ("--training.local_batch_size", "--training.seq_len"))
    return batch * seq * seq * 4 / 2**20


DATA = {"bundled": [], "short documents": ["--training.dataset_path", str(REPO / "tests/fixtures/short_documents.txt")]}
# (attn_mask_type, attn_backend)
VARIANTS = {"causal": ("causal", "sdpa"), "sdpa": ("block_causal", "sdpa"), "varlen": ("block_causal", "varlen")}


def run(case: str, data: str, variant: str, steps: int, warmup: int, dump: Path) -> tuple[float, float]:
    """(median step seconds, share of the measured steps' microbatches with a boundary)."""
    seen = []
    real = documents.document_ids

    def counting(tokens, eos_id, bos_id=None):
        ids = real(tokens, eos_id, bos_id)
        seen.append(bool(ids.any()))
        return ids

    documents.document_ids = counting
    mask, backend = VARIANTS[variant]
    try:
        config = load_config(overrides=CASES[case] + DATA[data] + [
            "--model.attn_mask_type", mask, "--model.attn_backend", backend, "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000",
            "--validation.no-enable", "--training.mixed_precision_param", "float32", "--job.dump_folder", str(dump)])
        result = main(config)
    finally:
        documents.document_ids = real
    measured = seen[len(seen) * warmup // steps:]  # the same number of microbatches in every step
    return statistics.median(result.step_times[warmup:]), (sum(measured) / len(measured) if measured else float("nan"))


def main_cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=at_least(1), default=10)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--repeats", type=at_least(1), default=2)
    a = parser.parse_args()
    check_timed_steps(parser, a)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.steps} steps (median of the last"
          f" {a.steps - a.warmup}), {a.repeats} alternating repeats\n")
    print("| model | data | microbatches with a boundary | causal step (s) | block_causal sdpa (s) | block_causal"
          " varlen (s) | sdpa / causal | varlen / causal | mask (MiB, sdpa) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            for data in DATA:
                times = {v: [] for v in VARIANTS}
                share = float("nan")
                for r in range(a.repeats):
                    for variant in list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]:
                        seconds, boundary = run(case, data, variant, a.steps, a.warmup,
                                                Path(tmp) / f"{case}-{data}-{variant}-{r}")
                        times[variant].append(seconds)
                        share = boundary if variant == "sdpa" else share
                ratio = {v: statistics.median(b / c for b, c in zip(times[v], times["causal"])) for v in VARIANTS}
                print(f"| {case} | {data} | {100 * share:.0f}% | {statistics.median(times['causal']):.3f} |"
                      f" {statistics.median(times['sdpa']):.3f} | {statistics.median(times['varlen']):.3f} |"
                      f" {ratio['sdpa']:.2f} | {ratio['varlen']:.2f} | {mask_mib(case):.1f} |")


if __name__ == "__main__":
    main_cli()
