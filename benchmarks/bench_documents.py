"""What block-causal attention costs: training step time with attn_mask_type = "causal" and "block_causal".

    python benchmarks/bench_documents.py [--cases debugmodel 270M] [--steps 10] [--repeats 2]

For each model case and dataset (the bundled documents, ~2,150 tokens each, where some windows cross a
boundary; and tests/fixtures/short_documents.txt, ~90 tokens each, where nearly every window does), the
median step time of each mask type, run alternately (causal, block_causal, causal, ...) ``--repeats``
times in one sitting, and their ratio (median over the repeats). One process, float32, this machine's
threads. The share of microbatches that held a boundary (and so ran the masked kernel) is printed too.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import trainer.data.documents as documents  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import main  # noqa: E402

CASES = {
    "debugmodel": ["--model.flavor", "debugmodel", "--training.local_batch_size", "8", "--training.seq_len", "256"],
    "270M": ["--model.flavor", "270M", "--training.local_batch_size", "2", "--training.seq_len", "512"],
}
DATA = {"bundled": [], "short documents": ["--training.dataset_path", str(REPO / "tests/fixtures/short_documents.txt")]}


def run(case: str, data: str, mask: str, steps: int, warmup: int, dump: Path) -> tuple[float, float]:
    """(median step seconds, share of microbatches with a boundary)."""
    seen = []
    real = documents.document_ids

    def counting(tokens, eos_id):
        ids = real(tokens, eos_id)
        seen.append(bool(ids.any()))
        return ids

    documents.document_ids = counting
    try:
        config = load_config(overrides=CASES[case] + DATA[data] + [
            "--model.attn_mask_type", mask, "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1",
            "--metrics.no-enable_tensorboard", "--metrics.log_freq", "1000", "--validation.no-enable",
            "--training.mixed_precision_param", "float32", "--job.dump_folder", str(dump)])
        result = main(config)
    finally:
        documents.document_ids = real
    return statistics.median(result.step_times[warmup:]), (sum(seen) / len(seen) if seen else float("nan"))


def main_cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    a = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.steps} steps (median of the last"
          f" {a.steps - a.warmup}), {a.repeats} alternating repeats\n")
    print("| model | data | microbatches with a boundary | causal step (s) | block_causal step (s) | block / causal |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            for data in DATA:
                times = {"causal": [], "block_causal": []}
                share = float("nan")
                for r in range(a.repeats):
                    for mask in ("causal", "block_causal") if r % 2 == 0 else ("block_causal", "causal"):
                        seconds, boundary = run(case, data, mask, a.steps, a.warmup,
                                                Path(tmp) / f"{case}-{data}-{mask}-{r}")
                        times[mask].append(seconds)
                        share = boundary if mask == "block_causal" else share
                ratio = statistics.median(b / c for b, c in zip(times["block_causal"], times["causal"]))
                print(f"| {case} | {data} | {100 * share:.0f}% | {statistics.median(times['causal']):.3f} |"
                      f" {statistics.median(times['block_causal']):.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main_cli()
