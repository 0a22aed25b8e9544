"""Tokenizer, document sources, packing, data-parallel sharding and exact resume."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer.config import load_config
from trainer.data import PackedBatchLoader, Tokenizer, build_tokenizer, load_documents
from trainer.data.sources import training_source
from trainer.errors import UserError

DOCS = ["alpha beta gamma", "delta", "epsilon zeta eta theta iota kappa", "lambda mu", "nu xi omicron pi rho"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(max_ranks=300)


def stream(tok, docs):
    out = []
    for d in docs:
        out += tok.encode(d, bos=True, eos=True)
    return out


def loader(tok, docs=DOCS, **kw):
    args = dict(text_column="text", seq_len=7, local_batch_size=2, accum_steps=1, dp_rank=0, dp_degree=1)
    args.update(kw)
    return PackedBatchLoader(datasets.Dataset.from_dict({"text": docs}), tok, **args)


def test_tokenizer_small_vocab_and_specials(tok):
    assert tok.vocab_size == 302 and (tok.bos_id, tok.eos_id) == (300, 301)
    ids = tok.encode("Hello <|end_of_text|> world", bos=True, eos=True)
    assert ids[0] == 300 and ids[-1] == 301 and max(ids[1:-1]) < 300  # special text stays text
    assert tok.decode(ids[1:-1]) == "Hello <|end_of_text|> world"


def test_tokenizer_fits_model_vocab():
    model = load_config().model
    assert build_tokenizer(model, 2048).vocab_size == 2048
    with pytest.raises(UserError, match=r"tokenizer_vocab_size=5000 .* vocab_size=2048; use at most 2046"):
        build_tokenizer(load_config(overrides=["--model.tokenizer_vocab_size", "5000"]).model, 2048)


def test_custom_tokenizer_file_and_corrupt_file(tmp_path, tok):
    import base64

    good = tmp_path / "tok.model"
    good.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    assert Tokenizer(good).vocab_size == 258
    bad = tmp_path / "bad.model"
    bad.write_text("this is not a tokenizer\n")
    with pytest.raises(UserError, match="tokenizer_path: .*bad.model is not a tiktoken BPE file"):
        Tokenizer(bad)


def test_packing_is_the_concatenated_stream(tok):
    flat = stream(tok, DOCS)
    step = loader(tok).next_step()
    (inputs, labels), = step
    assert inputs.shape == labels.shape == (2, 7)
    assert inputs[0].tolist() == flat[0:7] and labels[0].tolist() == flat[1:8]
    assert inputs[1].tolist() == flat[8:15] and labels[1].tolist() == flat[9:16]  # windows of seq_len + 1


def test_epochs_wrap_around(tok):
    flat = stream(tok, DOCS)
    ld = loader(tok)
    windows = []
    for _ in range(len(flat)):  # far more windows than one epoch holds
        windows += [m for inp, lab in ld.next_step() for m in torch.cat([inp, lab[:, -1:]], 1).tolist()]
    joined = [t for w in windows for t in w]
    assert joined[: 3 * len(flat)] == flat * 3


def test_data_parallel_ranks_split_the_global_batch(tok):
    whole = [loader(tok, local_batch_size=2, accum_steps=4).next_step() for _ in range(1)][0]
    whole_inputs = torch.cat([x for x, _ in whole])
    parts = []
    for rank in range(4):
        step = loader(tok, local_batch_size=2, accum_steps=1, dp_rank=rank, dp_degree=4).next_step()
        assert len(step) == 1
        parts.append(step[0][0])
    assert torch.equal(torch.cat(parts), whole_inputs)
    # accumulation: 2 microbatches of 2 on 2 ranks cover the same 8 windows in the same order
    r0 = loader(tok, local_batch_size=2, accum_steps=2, dp_rank=0, dp_degree=2).next_step()
    r1 = loader(tok, local_batch_size=2, accum_steps=2, dp_rank=1, dp_degree=2).next_step()
    assert torch.equal(torch.cat([x for x, _ in r0 + r1]), whole_inputs)


@pytest.mark.parametrize("consumed", [0, 1, 3, 7, 20])
def test_resume_is_exact(tok, consumed):
    ref = loader(tok)
    for _ in range(consumed):
        ref.next_step()
    state = ref.state_dict()
    resumed = loader(tok)
    resumed.load_state_dict(state)
    for _ in range(12):  # crosses document and epoch boundaries
        a, b = ref.next_step(), resumed.next_step()
        assert all(torch.equal(x, y) for pa_, pb_ in zip(a, b) for x, y in zip(pa_, pb_))


def test_resume_across_data_parallel_degrees(tok):
    """The position is global, so a run saved with dp=1 resumes with dp=2 on the same samples."""
    one = loader(tok, local_batch_size=4)
    one.next_step()
    state = one.state_dict()
    expected = one.next_step()[0][0]
    halves = []
    for rank in range(2):
        ld = loader(tok, local_batch_size=2, dp_rank=rank, dp_degree=2)
        ld.load_state_dict(state)
        halves.append(ld.next_step()[0][0])
    assert torch.equal(torch.cat(halves), expected)


def test_empty_and_non_text_datasets(tok):
    with pytest.raises(UserError, match="holds no text"):
        loader(tok, docs=[None, None]).next_step()
    ds = datasets.Dataset.from_dict({"text": [1, 2]})
    ld = PackedBatchLoader(ds, tok, text_column="text", seq_len=7, local_batch_size=1, accum_steps=1)
    with pytest.raises(UserError, match="document 0 holds int"):
        ld.next_step()


def docs_args(t):
    return training_source(t), t.dataloader


def training(tmp_path=None, **kw):
    args = []
    for k, v in kw.items():
        args += [f"--training.{k}", str(v)]
    return load_config(overrides=args).training


def test_bundled_default_is_real_text():
    ds = load_documents(*docs_args(training()))
    assert len(ds) > 50 and sum(len(t) for t in ds["text"]) > 300_000


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".json", ".parquet"])
def test_local_files(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".txt":
        path.write_text("\n\n".join(DOCS))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": d} for d in DOCS]))
    else:
        pq.write_table(pa.table({"text": DOCS}), path)
    assert list(load_documents(*docs_args(training(dataset_path=path)))["text"]) == DOCS


def test_local_folder_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}))
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "y"}))
    t = load_config(overrides=["--training.dataset_path", str(tmp_path), "--training.dataloader.text_column", "body"])
    assert list(load_documents(*docs_args(t.training))["body"]) == ["x", "y"]
    with pytest.raises(UserError, match=r"text_column: 'text' is not a column of the dataset \(columns: body\)"):
        load_documents(*docs_args(training(dataset_path=tmp_path)))
    (tmp_path / "c.txt").write_text("z")
    with pytest.raises(UserError, match="mixes file types"):
        load_documents(*docs_args(training(dataset_path=tmp_path)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .txt, .json, .jsonl, .parquet files in folder"):
        load_documents(*docs_args(training(dataset_path=empty)))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="cannot read .*bad.json as json"):
        load_documents(*docs_args(training(dataset_path=bad)))


def test_hub_path_streams_from_a_local_dataset_repo(tmp_path):
    """The hub code path (load_dataset by name, streaming) on a dataset folder laid out like a hub repo."""
    repo = tmp_path / "my_dataset"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "train-00000.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    ds = load_documents(*docs_args(training(dataset=str(repo))))
    assert isinstance(ds, datasets.IterableDataset)
    assert [row["text"] for row in ds] == DOCS
    ld = PackedBatchLoader(ds, Tokenizer(max_ranks=300), text_column="text", seq_len=7, local_batch_size=2, accum_steps=1)
    ld.next_step()
    state = ld.state_dict()
    expected = ld.next_step()
    ld2 = PackedBatchLoader(ds, Tokenizer(max_ranks=300), text_column="text", seq_len=7, local_batch_size=2, accum_steps=1)
    ld2.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, ld2.next_step()))


def test_unknown_hub_dataset_is_one_clear_line():
    with pytest.raises(UserError) as info:
        load_documents(*docs_args(training(dataset="no-such-org/no-such-dataset-xyz")))
    message = str(info.value)
    assert "[training] dataset: cannot load 'no-such-org/no-such-dataset-xyz'" in message and "\n" not in message
