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


def test_a_tokenizer_file_is_read_once_per_process_until_it_changes(tmp_path):
    import base64
    import os

    from trainer.config.schema import Model

    path = tmp_path / "tok.model"
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    model = Model(tokenizer_path=str(path))
    first = build_tokenizer(model, 512)
    assert build_tokenizer(model, 512) is first  # the same file: not read again
    assert build_tokenizer(model, 300) is not first and build_tokenizer(model, 300).vocab_size == 258
    path.write_text(path.read_text() + f"{base64.b64encode(b'ab').decode()} 256\n")
    os.utime(path, ns=(1, 1))  # another version of the file, whatever the clock's resolution
    changed = build_tokenizer(model, 512)
    assert changed is not first and (first.vocab_size, changed.vocab_size) == (258, 259)


def test_a_damaged_bundled_tokenizer_is_one_line(tmp_path, monkeypatch):
    import trainer.data.tokenizer as tokenizer_mod

    copy = tmp_path / "cl100k_base.tiktoken"
    data = bytearray(tokenizer_mod.default_tokenizer_path().read_bytes())
    data[100] ^= 1
    copy.write_bytes(bytes(data))
    monkeypatch.setattr(tokenizer_mod, "default_tokenizer_path", lambda: copy)
    with pytest.raises(UserError, match=r"the bundled tokenizer .*cl100k_base.tiktoken is damaged \(its sha256"):
        Tokenizer()


def test_custom_tokenizer_file_and_corrupt_file(tmp_path, tok):
    import base64

    good = tmp_path / "tok.model"
    good.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    assert Tokenizer(good).vocab_size == 258
    bad = tmp_path / "bad.model"
    bad.write_text("this is not a tokenizer\n")
    with pytest.raises(UserError, match="tokenizer_path: .*bad.model is not a tiktoken BPE file"):
        Tokenizer(bad)
    empty = tmp_path / "empty.model"
    empty.write_text("")
    with pytest.raises(UserError, match="tokenizer_path: .*empty.model holds no BPE ranks"):
        Tokenizer(empty)
    no_tab = tmp_path / "no_tab.model"  # byte 9 (tab) missing: tiktoken could not encode a tab
    no_tab.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i - (i > 9)}\n" for i in range(256) if i != 9))
    with pytest.raises(UserError, match=r"no_tab.model lacks 1 of the 256 single-byte tokens \(first: b'\\t'\)"):
        Tokenizer(no_tab)


def lane_windows(tok, docs, lane, lanes, count, window=8):
    """The first ``count`` windows of a lane, from the definition: documents lane, lane + lanes, ...
    of each epoch, concatenated epoch after epoch and cut into windows of seq_len + 1 tokens."""
    flat = []
    while len(flat) < count * window:
        flat += stream(tok, docs[lane::lanes])
    return [flat[i * window:(i + 1) * window] for i in range(count)]


def rows(step):
    """The windows (seq_len + 1 tokens) of one step's microbatches, in order."""
    return [w for inputs, labels in step for w in torch.cat([inputs, labels[:, -1:]], 1).tolist()]


def test_each_window_of_the_batch_is_a_lane_of_the_stream(tok):
    ld = loader(tok)  # 2 windows per global batch: lane 0 = documents 0, 2, 4; lane 1 = documents 1, 3
    steps = [rows(ld.next_step()) for _ in range(12)]  # crosses document and epoch boundaries
    for lane in range(2):
        assert [s[lane] for s in steps] == lane_windows(tok, DOCS, lane, 2, 12)
    (inputs, labels), = loader(tok).next_step()
    assert inputs.shape == labels.shape == (2, 7) and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_one_window_per_step_is_the_concatenated_stream_across_epochs(tok):
    flat = stream(tok, DOCS)
    ld = loader(tok, local_batch_size=1)
    joined = [t for _ in range(3 * len(flat) // 8 + 1) for t in rows(ld.next_step())[0]]
    assert joined[: 3 * len(flat)] == flat * 3


MANY = [f"{w} " * (1 + i % 7) + str(i) for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 6)]  # 24 docs


def test_data_parallel_ranks_split_the_global_batch(tok):
    whole = loader(tok, MANY, local_batch_size=2, accum_steps=4)
    steps = [rows(whole.next_step()) for _ in range(5)]
    for dp, local, accum in [(4, 2, 1), (2, 2, 2), (8, 1, 1), (2, 1, 4)]:
        ranks = [loader(tok, MANY, local_batch_size=local, accum_steps=accum, dp_rank=r, dp_degree=dp)
                 for r in range(dp)]
        for expected in steps:
            assert [w for ld in ranks for w in rows(ld.next_step())] == expected, (dp, local, accum)


def test_each_rank_tokenizes_only_its_own_documents(tok):
    """The cost lanes remove: at dp 4 a rank tokenizes only the documents of its own windows."""

    class Counting(Tokenizer):
        def encode(self, text, **kw):
            self.seen.append(MANY.index(text))
            return super().encode(text, **kw)

    seen = []
    for rank in range(4):
        counting = Counting(max_ranks=300)
        counting.seen = []
        ld = PackedBatchLoader(datasets.Dataset.from_dict({"text": MANY}), counting, text_column="text", seq_len=7,
                               local_batch_size=2, accum_steps=1, dp_rank=rank, dp_degree=4)
        for _ in range(6):
            ld.next_step()
        assert {i % 8 for i in counting.seen} <= {2 * rank, 2 * rank + 1}  # lanes 2r and 2r + 1 only
        seen.append(len(counting.seen))
        assert ld.tokenized == len(counting.seen)
    assert min(seen) > 0


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
    """Positions are per lane and each rank saves its own: the union resumes on another layout."""
    ranks = [loader(tok, MANY, local_batch_size=2, dp_rank=r, dp_degree=4) for r in range(4)]
    for _ in range(3):
        for ld in ranks:
            ld.next_step()
    state = {k: v for ld in ranks for k, v in ld.state_dict().items()}  # what the checkpoint holds
    assert sorted(k for k in state if k.startswith("lane") and k != "lanes") == sorted(
        f"lane{j}.{x}" for j in range(8) for x in ("epoch", "doc", "offset"))
    expected = [w for ld in ranks for w in rows(ld.next_step())]
    one = loader(tok, MANY, local_batch_size=4, accum_steps=2)
    one.load_state_dict(state)
    assert rows(one.next_step()) == expected


def test_resume_with_another_global_batch_restarts_every_lane_without_skipping(tok, caplog):
    ld = loader(tok, MANY, local_batch_size=4)
    for _ in range(3):
        ld.next_step()
    state = ld.state_dict()
    earliest = min((state[f"lane{j}.epoch"], state[f"lane{j}.doc"]) for j in range(4))
    other = loader(tok, MANY, local_batch_size=2)
    other.load_state_dict(state)
    assert "saved with 4 lanes" in caplog.text and f"restarts at document {earliest[1]}" in caplog.text
    first = rows(other.next_step())
    for lane in range(2):
        doc = earliest[1] + (lane - earliest[1]) % 2  # the lane's first document at or after the restart
        assert first[lane] == stream(tok, MANY[doc::2])[:8]


def test_a_stream_with_fewer_documents_than_windows_is_refused(tok):
    with pytest.raises(UserError, match="the stream holds 5 documents, fewer than the 8 windows of a global batch"):
        loader(tok, local_batch_size=8).next_step()


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
    ld = PackedBatchLoader(ds, Tokenizer(max_ranks=300), text_column="text", seq_len=7, local_batch_size=2,
                           accum_steps=1)
    ld.next_step()
    state = ld.state_dict()
    expected = ld.next_step()
    ld2 = PackedBatchLoader(ds, Tokenizer(max_ranks=300), text_column="text", seq_len=7, local_batch_size=2,
                            accum_steps=1)
    ld2.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, ld2.next_step()))


def test_unknown_hub_dataset_is_one_clear_line():
    with pytest.raises(UserError) as info:
        load_documents(*docs_args(training(dataset="no-such-org/no-such-dataset-xyz")))
    message = str(info.value)
    assert "[training] dataset: cannot load 'no-such-org/no-such-dataset-xyz'" in message and "\n" not in message
