"""Data on the critical path: per-step data time against the data-parallel degree, preparation
throughput, and the debug model's step time with and without prefetch.

    python benchmarks/bench_data.py            # prints a markdown table (docs/performance.md)

Data-parallel degrees are simulated in one process: a rank's data work depends only on its rank
and the degree, not on the other processes, so rank 0 of each degree is timed alone. The batch
is one 8192-token sequence per rank, as in the issue that motivated the shard loader.

- streaming loader (trainer.data.stream, used for streamed hub data): the stream is dealt into one
  lane per window of the global batch; a rank tokenizes only its own lanes' documents, but reads
  every row of the stream to find them (timed per step, with the documents it tokenized);
- shard loader (trainer.data.loader): every rank reads its own windows from the memory-mapped
  shards; measured without prefetch (the read itself) and with prefetch after a simulated 50 ms
  step (the time next_step() still blocks).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arguments import at_least  # benchmarks/arguments.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402

from trainer.data import PackedBatchLoader, Tokenizer, TokenShards, WindowLoader, WindowOrder  # noqa: E402
from trainer.data.shards import prepare_shards  # noqa: E402
from trainer.data.sources import bundled_documents  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=at_least(1), default=8192)
    ap.add_argument("--dp", type=at_least(1), nargs="+", default=[1, 8, 64, 1024])
    ap.add_argument("--copies", type=at_least(1), default=20,
                    help="bundled corpus copies to prepare (size of the corpus)")
    ap.add_argument("--no-train", action="store_true", help="skip the debug-model step-time runs")
    args = ap.parse_args()
    tok = Tokenizer(max_ranks=2046)  # the debug model's tokenizer
    docs = bundled_documents() * args.copies
    with tempfile.TemporaryDirectory() as tmp:
        summary = prepare_shards(docs, tok, Path(tmp) / "shards", source="bundled x copies", show_progress=False)
        shards = TokenShards(Path(tmp) / "shards")
        print(f"prepare: {summary['documents']} documents, {summary['tokens']:,} tokens in {summary['seconds']:.2f} s"
              f" = {summary['tokens_per_second'] / 1e6:.2f} M tokens/s\n")
        print("| dp | streaming loader (ms/step) | documents tokenized per step | shard loader: read (ms/step)"
              " | shard loader + prefetch: wait after 50 ms step (ms) |")
        print("|---:|---:|---:|---:|---:|")
        stream_docs = datasets.Dataset.from_dict({"text": docs})
        for dp in args.dp:
            stream = PackedBatchLoader(stream_docs, tok, text_column="text", seq_len=args.seq_len, local_batch_size=1,
                                       accum_steps=1, dp_rank=0, dp_degree=dp)
            repeats = 3 if dp >= 256 else 7
            t_stream = median_time(stream.next_step, repeats)
            per_step = stream.tokenized / repeats
            order = WindowOrder([shards], [1.0], args.seq_len + 1, seed=0, shuffle=True, names=["bundled"])
            plain = WindowLoader(order, local_batch_size=1, accum_steps=1, dp_rank=0, dp_degree=dp, prefetch=False)
            t_read = median_time(plain.next_step, 21)
            ahead = WindowLoader(order, local_batch_size=1, accum_steps=1, dp_rank=0, dp_degree=dp, prefetch=True)
            ahead.next_step()
            waits = []
            for _ in range(21):
                time.sleep(0.05)  # the step's compute
                start = time.perf_counter()
                ahead.next_step()
                waits.append(time.perf_counter() - start)
            ahead.close()
            print(f"| {dp} | {t_stream * 1e3:.1f} | {per_step:.1f} | {t_read * 1e3:.2f} |"
                  f" {statistics.median(waits) * 1e3:.3f} |")
    if not args.no_train:
        from trainer.config import load_config
        from trainer.train import main as train

        print("\n| debug model, 20 steps | median step time (s) |\n|---|---:|")
        for prefetch in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                flag = "--training.dataloader.prefetch" if prefetch else "--training.dataloader.no-prefetch"
                config = load_config("configs/debug_model.toml", [flag, "--job.dump_folder", tmp,
                                                                  "--metrics.no-enable_tensorboard"])
                result = train(config)
                print(f"| prefetch {'on' if prefetch else 'off'} | {statistics.median(result.step_times[1:]):.3f} |")


if __name__ == "__main__":
    main()
