"""Token shards and the window loader: deterministic preparation, order independent of the
data-parallel degree, exact resume across a degree change, shuffling, weighted mixing, refusals.

Expected values are derived from the tokenizer directly (the stream is every document's
[BOS text EOS], concatenated), never from the loader's own output.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainer.data import HFTokenizer, Tokenizer, TokenShards, WindowLoader, WindowOrder, prepare_shards
from trainer.data.loader import MIX_BLOCK, feistel_permute, mix_pattern
from trainer.errors import UserError

DOCS = [f"document {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) * (1 + i % 3) for i in range(40)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(max_ranks=300)


def flat(tok, docs=DOCS):
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


@pytest.fixture(scope="module")
def shards(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "a"
    prepare_shards(DOCS, tok, folder, source="docs", shard_tokens=50)  # many small shards
    return TokenShards(folder)


def windows_of(step):
    """A step's windows (inputs plus the last label) as lists, microbatches in order."""
    return [w for x, y in step for w in torch.cat([x, y[:, -1:]], 1).tolist()]


def test_prepare_writes_the_token_stream_and_is_deterministic(tok, tmp_path, shards):
    stream = flat(tok)
    assert shards.num_tokens == len(stream) and shards.num_documents == len(DOCS) and len(shards.shards) > 3
    assert shards.read(0, len(stream)).tolist() == stream
    assert shards.read(47, 30).tolist() == stream[47:77]  # across shard boundaries
    a, b = tmp_path / "a", tmp_path / "b"
    prepare_shards(DOCS, tok, a, source="docs", shard_tokens=50)
    prepare_shards(iter(DOCS), tok, b, source="docs", shard_tokens=50)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and "index.json" in files
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    index = json.loads((a / "index.json").read_text())
    assert index["tokenizer"] == {"identity": tok.identity, "vocab_size": 302} and index["dtype"] == "uint16"
    # document boundaries: each shard's end offsets land on EOS tokens
    ends = np.fromfile(a / index["shards"][0]["docs"], dtype="<u8")
    first = shards.read(0, index["shards"][0]["num_tokens"])
    assert all(first[e - 1] == tok.eos_id for e in ends) and ends[-1] == len(first)
    with pytest.raises(UserError, match="already holds a prepared dataset"):
        prepare_shards(DOCS, tok, a, source="docs")


def order(shards_list, window=9, shuffle=False, weights=None, seed=0):
    weights = weights or [1.0] * len(shards_list)
    return WindowOrder(shards_list, weights, window, seed=seed, shuffle=shuffle,
                       names=[f"d{i}" for i in range(len(shards_list))])


def loader(o, *, batch, accum=1, rank=0, dp=1, prefetch=False):
    return WindowLoader(o, local_batch_size=batch, accum_steps=accum, dp_rank=rank, dp_degree=dp, prefetch=prefetch)


def test_windows_are_the_stream_cut_in_order(tok, shards):
    stream = flat(tok)
    ld = loader(order([shards]), batch=2)
    got = windows_of(ld.next_step()) + windows_of(ld.next_step())
    assert got == [stream[i * 9:(i + 1) * 9] for i in range(4)]
    (x, y), = ld.next_step()
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("shuffle", [False, True])
def test_window_order_is_independent_of_the_data_parallel_degree(shards, tmp_path, tok, shuffle):
    other = tmp_path / "b"
    prepare_shards(DOCS[::-1], tok, other, source="rev")
    datasets = [shards, TokenShards(other)]
    ref = loader(order(datasets, shuffle=shuffle, weights=[3, 1]), batch=2, accum=4)  # one process, 4 microbatches
    expected = [windows_of(ref.next_step()) for _ in range(30)]  # crosses epochs of both datasets
    for dp, accum in ((2, 1), (2, 2), (4, 1), (4, 2), (8, 1)):
        ranks = [loader(order(datasets, shuffle=shuffle, weights=[3, 1]), batch=8 // dp // accum, accum=accum, rank=r,
                        dp=dp, prefetch=True) for r in range(dp)]
        for step in range(30):
            assert [w for ld in ranks for w in windows_of(ld.next_step())] == expected[step], (dp, step)


def test_resume_across_a_data_parallel_degree_change_is_exact(shards):
    o = order([shards], shuffle=True)
    one = loader(o, batch=8)
    expected = [windows_of(one.next_step()) for _ in range(12)]
    two = [loader(o, batch=4, rank=r, dp=2, prefetch=True) for r in range(2)]
    for step in range(5):
        assert [w for ld in two for w in windows_of(ld.next_step())] == expected[step]
    state = two[0].state_dict()
    assert state == two[1].state_dict() == {"windows": 40, "window_tokens": 9}  # prefetched windows not counted
    four = [loader(o, batch=2, rank=r, dp=4) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    for step in range(5, 12):
        assert [w for ld in four for w in windows_of(ld.next_step())] == expected[step]


def test_resume_with_another_seq_len_continues_after_the_tokens_consumed(tok, shards, caplog):
    """Saved after 6 windows of 9 tokens (54 tokens of the stream); resumed with windows of 13: the
    next window starts at the first whole window past token 54, ceil(54 / 13) = 5, i.e. token 65, so no
    text is seen twice and at most one window's worth is skipped. Unshuffled, that is the stream itself."""
    stream = flat(tok)
    first = loader(order([shards], window=9), batch=2)
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state == {"windows": 6, "window_tokens": 9}
    wider = loader(order([shards], window=13), batch=2)
    wider.load_state_dict(state)
    assert "resuming with seq_len + 1 = 13 instead of 9: data position converted by tokens" in caplog.text
    assert wider.state_dict() == {"windows": 5, "window_tokens": 13}  # ceil(6 x 9 / 13)
    assert windows_of(wider.next_step())[0] == stream[5 * 13:6 * 13]


def test_shuffle_permutes_each_epoch_differently_and_reproducibly(shards):
    o = order([shards], shuffle=True, seed=7)
    n = o.num_windows[0]
    _, first = o.locate(np.arange(n))
    _, second = o.locate(np.arange(n, 2 * n))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))  # every window once per epoch
    assert first.tolist() != list(range(n)) and first.tolist() != second.tolist()
    assert o.locate(np.arange(n))[1].tolist() == first.tolist()
    assert order([shards], shuffle=True, seed=8).locate(np.arange(n))[1].tolist() != first.tolist()
    for size in (1, 2, 3, 17, 1000, 4097):
        assert sorted(feistel_permute(np.arange(size), size, np.uint64(size)).tolist()) == list(range(size))


def test_mixing_follows_the_weights_exactly_and_reproducibly(shards, tmp_path, tok):
    others = []
    for name in ("b", "c"):
        prepare_shards(DOCS[:10], tok, tmp_path / name, source=name)
        others.append(TokenShards(tmp_path / name))
    weights = [5.0, 3.0, 0.5]
    o = order([shards, *others], weights=weights)
    g = 3 * MIX_BLOCK + 1234
    k, _ = o.locate(np.arange(g))
    share = np.bincount(k, minlength=3) / g
    assert np.abs(share - np.array(weights) / sum(weights)).max() < 0.01
    assert np.bincount(k, minlength=3).tolist() == o.counts(g).tolist()
    # every dataset's windows come in its own order: the c-th pick of dataset d is its window c (mod epoch)
    k, i = o.locate(np.arange(g))
    for d in range(3):
        picks = i[k == d]
        assert picks.tolist() == (np.arange(len(picks)) % o.num_windows[d]).tolist()
    assert o.locate(np.arange(g))[0].tolist() == k.tolist()
    ld = loader(o, batch=4)
    for _ in range(100):
        ld.next_step()
    assert abs(sum(ld.shares().values()) - 1) < 1e-12 and set(ld.shares()) == {"d0", "d1", "d2"}
    slots, _, counts = mix_pattern([1, 1, 1])
    assert counts.sum() == MIX_BLOCK and sorted(counts.tolist()) == [3333, 3333, 3334]


def test_prefetch_reads_the_next_step_in_the_background_and_gives_the_same_batches(shards):
    import threading

    a, b = loader(order([shards]), batch=3, prefetch=True), loader(order([shards]), batch=3)
    readers = []
    real = a.order.read
    a.order.read = lambda g: (readers.append(threading.current_thread().name), real(g))[1]
    for _ in range(10):
        assert windows_of(a.next_step()) == windows_of(b.next_step())
    a.close()
    assert readers[0] == threading.current_thread().name  # the first step has nothing read ahead
    assert all(name.startswith("data") for name in readers[1:])
    # steps 2..10 were read ahead; the read ahead of step 11 may not have started when close() cancels it
    assert len(readers) in (10, 11)


def test_shards_made_with_another_tokenizer_are_refused(shards):
    other = Tokenizer(max_ranks=400)
    with pytest.raises(UserError, match=r"prepared with tokenizer tiktoken:.*ranks=300 \(vocabulary 302\),"
                                        r" but \[model\] uses tiktoken:.*ranks=400 \(vocabulary 402\)"):
        shards.check_tokenizer(other.identity, other.vocab_size)


def test_damaged_shards_are_one_line_naming_the_file(tok, tmp_path):
    folder = tmp_path / "s"
    prepare_shards(DOCS, tok, folder, source="docs", shard_tokens=100)
    index = json.loads((folder / "index.json").read_text())
    shard = folder / index["shards"][1]["tokens"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    with pytest.raises(UserError, match=r"shard file .*tokens-00001.bin holds \d+ bytes, but index.json says"):
        TokenShards(folder)
    shard.unlink()
    with pytest.raises(UserError, match="shard file .*tokens-00001.bin listed in index.json is missing"):
        TokenShards(folder)
    (folder / "index.json").write_text("{}")
    with pytest.raises(UserError, match="is not a version-1 trainer.token_shards index"):
        TokenShards(folder)
    (folder / "index.json").write_text("{not json")
    with pytest.raises(UserError, match=r"index.json is not a trainer.token_shards index \(malformed JSON"):
        TokenShards(folder)
    with pytest.raises(UserError, match="has no index.json; prepare it with python -m trainer.prepare"):
        TokenShards(tmp_path)
    with pytest.raises(UserError, match="holds no text to prepare"):
        prepare_shards([], tok, tmp_path / "empty", source="nothing")
    tiny = tmp_path / "tiny"
    prepare_shards(["a"], tok, tiny, source="tiny")
    with pytest.raises(UserError, match="holds 3 tokens, fewer than one window of"):
        order([TokenShards(tiny)])


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    """A small byte-level BPE trained with the tokenizers library, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"]))
    folder = tmp_path_factory.mktemp("hf")
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    return folder / "tokenizer.json", hf


def test_hugging_face_tokenizer_json(hf_tokenizer_file, tmp_path):
    path, hf = hf_tokenizer_file
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (hf.token_to_id("<s>"), hf.token_to_id("</s>")) == (0, 1)
    assert tok.vocab_size == hf.get_vocab_size()
    text = "document 3: alpha beta"
    ids = hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, bos=True, eos=True) == [0, *ids, 1] and tok.decode(ids) == text
    assert tok.encode_documents([text, "x"]) == [[0, *ids, 1], [0, *hf.encode("x").ids, 1]]
    prepare_shards(DOCS, tok, tmp_path / "s", source="docs")
    s = TokenShards(tmp_path / "s")
    assert s.read(0, s.num_tokens).tolist() == [t for d in DOCS for t in tok.encode(d, bos=True, eos=True)]
    assert s.tokenizer_identity.startswith("hf:tokenizer.json:sha256=")
    (path.parent / "tokenizer_config.json").unlink()  # falls back to the usual names
    assert (HFTokenizer(path).bos_id, HFTokenizer(path).eos_id) == (0, 1)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="is not a Hugging Face tokenizer.json"):
        HFTokenizer(bad)


def test_prepare_command(tmp_path, capsys):
    """The command as a user runs it once (python -m trainer.prepare); the rest in this process, through the same
    run(argv) that its __main__ calls."""
    from trainer.prepare import run

    def prepare(*argv) -> tuple[int, str, str]:
        code = run(list(argv))
        printed = capsys.readouterr()
        return code, printed.out, printed.err

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "prepared"
    cmd = [sys.executable, "-m", "trainer.prepare", str(out), "--training.dataset_path", str(data)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"{len(DOCS)} documents" in done.stdout and (out / "index.json").is_file()
    code, _, err = prepare(str(out), "--training.dataset_path", str(data))
    assert code == 2 and err.count("\n") == 1 and "already holds a prepared dataset" in err
    code, _, err = prepare(str(tmp_path / "x"), "--training.dataset_path", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "dataset_path" in err
    # --verify: every token file against the sha256 recorded at preparation; a flipped bit that keeps
    # the size (which a run's start-up check cannot see) is named in one line.
    code, printed, err = prepare("--verify", str(out))
    assert code == 0 and "every sha256 as prepared" in printed, err
    tokens = out / "tokens-00000.bin"
    data = bytearray(tokens.read_bytes())
    data[len(data) // 2] ^= 1
    tokens.write_bytes(bytes(data))
    code, _, err = prepare("--verify", str(out))
    assert code == 2 and err.count("\n") == 1
    assert "--verify: shard file" in err and "tokens-00000.bin has other contents than when it was prepared" in err
    # --verify without a folder: the usage line, exit 2 (issue 34)
    code, _, err = prepare("--verify")
    assert code == 2 and err.startswith("usage: python -m trainer.prepare")


def test_a_token_id_outside_the_vocabulary_names_the_shard_file(tok, tmp_path):
    """A flipped byte that keeps the file's size but makes an id the embedding has no row for is caught
    when the window is read, naming the file, not as an IndexError inside the model."""
    folder = tmp_path / "s"
    prepare_shards(DOCS, tok, folder, source="docs", shard_tokens=100)
    shards = TokenShards(folder)
    whole = shards.read(0, shards.num_tokens)
    assert whole.max() < tok.vocab_size
    index = json.loads((folder / "index.json").read_text())
    path = folder / index["shards"][1]["tokens"]
    data = bytearray(path.read_bytes())
    data[7] ^= 0x80  # the high byte of token 3 (little-endian uint16): an id >= 32768
    path.write_bytes(bytes(data))
    first = index["shards"][0]["num_tokens"]
    shards = TokenShards(folder)
    shards.read(0, first)  # shard 0 is intact
    with pytest.raises(UserError, match=r"shard file .*tokens-00001.bin holds token id \d+ at token 3, outside the"
                                        r" vocabulary of 302: the file is damaged"):
        shards.read(first - 5, 20)


@pytest.mark.parametrize("where", ["file", "folder with files", "impossible"])
def test_prepare_into_a_path_that_cannot_hold_it_is_one_line(tok, tmp_path, where):
    out = tmp_path / "out"
    if where == "file":
        out.write_text("mine")
        words = r"output folder .*out is a file; choose a new folder"
    elif where == "folder with files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        words = r"output folder .*out is a folder holding other files"
    else:
        out = tmp_path / "a_file" / "out"
        (tmp_path / "a_file").write_text("mine")
        words = r"output folder .*a_file/out: cannot create .*a_file"
    with pytest.raises(UserError, match=words):
        prepare_shards(DOCS, tok, out, source="docs")
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]  # nothing left behind
    if where != "impossible":
        assert (out.read_text() if where == "file" else (out / "notes.txt").read_text()) == "mine"


def test_long_phases_log_a_progress_line_every_half_minute(caplog):
    """Progress lines: none before 10 s, then at most one per 30 s, with the share done and the time left derived
    from the rate so far (25 of 100 after 12 s: 36 s left)."""
    import logging

    from trainer.log import Progress

    now = [0.0]
    progress = Progress("validation", 100, unit="global batches", clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="trainer.progress"):
        for done, t in ((5, 9.9), (25, 12.0), (30, 41.9), (50, 42.0), (60, 50.0)):
            now[0] = t
            progress.update(done)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["validation: 25/100 global batches after 12 s, about 36 s left",
                     "validation: 50/100 global batches after 42 s, about 42 s left"]


def test_preparing_without_a_terminal_logs_progress_lines_instead_of_a_bar(tok, tmp_path, caplog, monkeypatch):
    import logging

    import trainer.log

    ticks = iter(range(0, 10_000, 20))  # every clock reading 20 s later than the last
    monkeypatch.setattr(trainer.log.Progress, "__init__", _with_clock(trainer.log.Progress.__init__, ticks))
    with caplog.at_level(logging.INFO, logger="trainer.progress"):
        prepare_shards(DOCS * 300, tok, tmp_path / "p", source="docs", show_progress=False)  # 12,000 documents
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("tokenizing: ") and " documents after " in line and " tokens)" in line
                         for line in lines)


def _with_clock(init, ticks):
    def wrapped(self, *args, **kwargs):
        init(self, *args, clock=lambda: float(next(ticks)), **kwargs)
    return wrapped
