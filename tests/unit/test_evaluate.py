"""Validation in one process: the logged loss is the token-mean cross-entropy of the held-out
windows under the trained weights, recomputed here from the raw text; mixing and its config errors."""

import json

import datasets
import pytest
import torch
import torch.nn.functional as F

import trainer.train as train_mod
from trainer.config import load_config
from trainer.data import Tokenizer
from trainer.data.sources import bundled_documents
from trainer.errors import ConfigError


class KeepModel:
    def on_grads(self, step, parts):
        pass

    def on_end(self, parts):
        self.model = parts.chunks[0]


# The expected losses are computed in float32 from the kept model: the run too, also on CUDA (where "auto" is bf16).
FP32 = ["--training.mixed_precision_param", "float32"]


def test_validation_loss_is_the_cross_entropy_of_the_held_out_windows(tiny_args, monkeypatch, caplog):
    overrides = [*tiny_args, "--training.steps", "4", "--validation.enable", "--validation.split", "train[80%:]",
                 "--validation.freq", "2", "--validation.steps", "2", *FP32]
    config = load_config(overrides=overrides)
    keep = KeepModel()
    import functools

    import trainer.evaluate
    # progress lines due at once (a real evaluation shows its first after 10 s, then one per 30 s)
    monkeypatch.setattr(trainer.evaluate, "Progress", functools.partial(trainer.evaluate.Progress, first=0, every=0))
    with caplog.at_level("INFO", logger="trainer.progress"):
        result = train_mod.main(config, observer=keep)
    assert sorted(result.eval_losses) == [2, 4]  # every freq steps (and after the last)
    progress = [r.getMessage().split(" after ")[0] for r in caplog.records if r.name == "trainer.progress"]
    assert progress == ["validation: 1/2 global batches", "validation: 2/2 global batches"] * 2
    # Independently: the held-out documents (the split's slice of the bundled list), [BOS text EOS]
    # each, concatenated, cut into windows of seq_len + 1; two global batches of them.
    docs = bundled_documents()
    (part,) = datasets.ReadInstruction.from_spec("train[80%:]").to_absolute({"train": len(docs)})
    tok = Tokenizer(max_ranks=config.model.overrides["vocab_size"] - 2)
    stream = [t for d in docs[part.from_:part.to] for t in tok.encode(d, bos=True, eos=True)]
    window, batch = config.training.seq_len + 1, config.training.local_batch_size
    windows = torch.tensor(stream[: 2 * batch * window]).view(2 * batch, window)
    with torch.no_grad():
        logits = keep.model(windows[:, :-1].to(next(keep.model.parameters()).device)).cpu()
    expected = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()
    assert result.eval_losses[4] == pytest.approx(expected, rel=1e-5)
    assert result.eval_losses[2] != result.eval_losses[4]  # the weights changed in between


def held_out_windows(config, spec: str) -> torch.Tensor:
    """Every whole global batch of windows of the bundled documents' slice ``spec``, derived independently."""
    docs = bundled_documents()
    (part,) = datasets.ReadInstruction.from_spec(spec).to_absolute({"train": len(docs)})
    tok = Tokenizer(max_ranks=config.model.overrides["vocab_size"] - 2)
    stream = [t for d in docs[part.from_:part.to] for t in tok.encode(d, bos=True, eos=True)]
    window, batch = config.training.seq_len + 1, config.training.local_batch_size
    n = len(stream) // window // batch * batch
    return torch.tensor(stream[: n * window]).view(n, window)


def test_a_small_validation_set_and_oversized_steps(tiny_args, caplog):
    """More steps asked than the held-out slice has batches: every whole batch it has is evaluated (not
    none, which would be NaN), with a warning; the loss is their cross-entropy."""
    config = load_config(overrides=[*tiny_args, "--training.steps", "1", "--validation.enable",
                                    "--validation.split", "train[99%:]", "--validation.steps", "1000", *FP32])
    keep = KeepModel()
    with caplog.at_level("WARNING"):
        result = train_mod.main(config, observer=keep)
    assert list(result.eval_losses) == [1] and "[validation] steps=1000 exceeds the" in caplog.text
    windows = held_out_windows(config, "train[99%:]")
    assert len(windows) > 0
    with torch.no_grad():
        logits = keep.model(windows[:, :-1].to(next(keep.model.parameters()).device)).cpu()
    expected = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()
    assert result.eval_losses[1] == pytest.approx(expected, rel=1e-5)


def test_training_on_a_weighted_mix(tiny_args, tmp_path):
    paths = []
    for name, word in (("a", "apple"), ("b", "banana")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{word} {i} " * 20}) + "\n" for i in range(50)))
        paths.append(str(path))
    job = tmp_path / "mix.toml"
    job.write_text(f'[training.dataset_mix]\n"{paths[0]}" = 3\n"{paths[1]}" = 1\n')
    config = load_config(job, overrides=[*tiny_args, "--training.steps", "2"])
    seen = []
    real = train_mod.build_train_loader

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    train_mod.build_train_loader = spy
    try:
        train_mod.main(config)
    finally:
        train_mod.build_train_loader = real
    shares = seen[0].shares()
    assert list(shares) == paths and shares[paths[0]] == pytest.approx(0.75, abs=1 / 16)


@pytest.mark.parametrize("weight, message", [
    ("0", "weight 0 must be a finite number > 0"),
    ("-1", "weight -1 must be a finite number > 0"),
    ("'x'", "weight 'x' is not a number"),
])
def test_bad_mix_weights_name_the_key(weight, message):
    with pytest.raises(ConfigError, match=r"\[training.dataset_mix\] 'python_docs': " + message):
        load_config(overrides=["--training.dataset_mix.python_docs", weight])


def test_a_mix_entry_that_is_a_missing_file_says_so(tmp_path):
    job = tmp_path / "mix.toml"
    job.write_text('[training.dataset_mix]\npython_docs = 1\n"data/missing.jsonl" = 1\n')
    with pytest.raises(ConfigError, match=r"\[training.dataset_mix\] 'data/missing.jsonl': file not found: data/missing"
                                        r".jsonl \(looked for .*\)"):
        load_config(job)


def test_a_streamed_hub_dataset_cannot_be_mixed(tmp_path):
    job = tmp_path / "mix.toml"
    job.write_text('[training.dataset_mix]\npython_docs = 1\n"org/web" = 1\n')
    with pytest.raises(ConfigError, match=r"\[training.dataset_mix\] mixes prepared or downloaded datasets only"):
        load_config(job)
    load_config(job, overrides=["--training.dataloader.no-streaming"])


def test_each_dataset_of_a_mix_reads_its_own_split_or_the_shared_one(tmp_path, caplog):
    """[training.dataloader] split applies to the datasets of a mix that name no split of their own;
    one with {weight, split} reads its own; the mix is logged with every dataset's split and size."""
    from trainer.data import build_train_loader

    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name} document {i}. " * 12}) + "\n" for i in range(20)))
        paths.append(str(path))
    job = tmp_path / "mix.toml"
    job.write_text(f'[training.dataloader]\nsplit = "train[:50%]"\n[training.dataset_mix]\n"{paths[0]}" = 3\n'
                   f'"{paths[1]}" = {{weight = 1, split = "train"}}\n')
    config = load_config(job, overrides=["--training.seq_len", "16", "--job.dump_folder", str(tmp_path / "out")])
    with caplog.at_level("INFO"):
        loader = build_train_loader(config.training, Tokenizer(), dump_folder=str(tmp_path / "out"), seed=0,
                                    accum_steps=1, dp_rank=0, dp_degree=1, wait_seconds=10)
    assert [d.num_documents for d in loader.order.datasets] == [10, 20]  # half of a, all of b
    assert f"{paths[0]}: weight 3 (75.0% of windows), split 'train[:50%]' ([training.dataloader] split)," \
           f" 10 documents" in caplog.text
    assert f"{paths[1]}: weight 1 (25.0% of windows), split 'train' (its own), 20 documents" in caplog.text


@pytest.mark.parametrize("entry, message", [
    ('{split = "train"}', r"expected a weight or a table .* \(no weight\)"),
    ('{weight = 1, splt = "train"}', r"expected a weight or a table .* \(unknown: splt\)"),
    ('{weight = 1, split = 3}', r"split 3 is not a split name"),
    ('{weight = 0, split = "train"}', r"weight 0 must be a finite number > 0"),
])
def test_bad_mix_entries_name_the_dataset(tmp_path, entry, message):
    job = tmp_path / "mix.toml"
    job.write_text(f'[training.dataset_mix]\npython_docs = {entry}\n')
    with pytest.raises(ConfigError, match=r"\[training.dataset_mix\] 'python_docs': " + message):
        load_config(job, overrides=["--training.dataloader.no-streaming"])
