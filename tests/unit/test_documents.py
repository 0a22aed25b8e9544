"""Block-causal attention (issue 29): a packed window computes what each of its documents computes alone."""

import pytest
import torch

from tests.conftest import load_plan
from trainer.data.documents import document_ids, model_inputs, on_device, positions_in_documents
from trainer.models.init import materialize_

EOS = 511
FAMILIES = {
    "llama3": ["--model.overrides.n_layers", "2"],
    "moe": ["--model.name", "moe", "--model.overrides.n_layers", "3", "--model.overrides.n_dense_layers", "1"],
}
TINY = ["--model.overrides.dim", "64", "--model.overrides.n_heads", "4", "--model.overrides.n_kv_heads", "2",
        "--model.overrides.vocab_size", "512", "--training.seq_len", "32"]

CPU_ONLY_VARLEN = pytest.mark.cpu_only("attn_backend varlen is CPU-only: the plan refuses it on CUDA")


def model_of(family: str, backend: str = "sdpa"):
    model = load_plan(TINY + FAMILIES[family] + ["--model.attn_backend", backend], 1).build_model()
    materialize_(model, torch.device("cpu"), seed=0)
    with torch.no_grad():  # larger weights than the init's, so that attention to another document shows
        for p in model.parameters():
            p.mul_(3.0)
    return model.eval()


def test_document_ids_begin_after_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [9, 9, 9, 9, 9, 9, 9]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0] * 7]
    # GPT-2's <|endoftext|> both begins and ends documents: E text E E text E
    assert (document_ids(torch.tensor([[EOS, 5, 6, EOS, EOS, 7, 8, EOS]]), EOS, EOS).tolist()
            == [[0, 0, 0, 0, 1, 1, 1, 1]])


def positions_of(tokens: torch.Tensor) -> torch.Tensor:
    return positions_in_documents(document_ids(tokens, EOS))


def test_the_host_decides_whether_a_batch_needs_a_mask():
    """Positions are given for a batch in which a window crosses an end-of-text, and not for one whose windows are
    each one document (the causal kernel computes the same there); nothing is given under causal attention. Under
    ``always`` (context parallelism, traced stages) every batch gets them, the window's own under causal attention."""
    inputs = model_inputs("block_causal", EOS)
    crossing = torch.tensor([[5, 6, 7, 8], [5, EOS, 7, 8]])
    assert inputs(crossing)["positions"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    one_each = torch.tensor([[5, 6, 7, 8], [9, 9, 9, EOS]])
    assert inputs(one_each) == {}  # an end-of-text at the end begins nothing
    assert model_inputs("causal", EOS)(crossing) == {}
    assert model_inputs("block_causal", EOS, always=True)(one_each)["positions"].tolist() == [[0, 1, 2, 3]] * 2
    assert model_inputs("causal", EOS, always=True)(crossing)["positions"].tolist() == [[0, 1, 2, 3]] * 2
    on, kwargs = on_device([(crossing, crossing), (crossing[:1], crossing[:1])], torch.device("meta"), inputs)
    assert [x.device.type for x, _ in on] == ["meta", "meta"]
    assert kwargs[0]["positions"].device.type == "meta" and kwargs[1] == {}


def test_the_block_causal_mask_and_its_rows_under_a_sequence_layout():
    """The mask from positions lets a query see the keys of its own document up to itself (a window of documents
    of 3, 1 and 4 tokens, checked against pairs of document indices), and within a window, the last ``window``
    of those; under a SequenceLayout (context parallelism: a rank's tokens at global indices 0, 1, 6, 7 of 8) it is
    those queries' rows of the whole mask, against every key."""
    from trainer.models.attention import SequenceLayout, block_causal_mask

    tokens = torch.tensor([[5, 6, EOS, EOS, 7, 8, 9, 9]])
    ids = document_ids(tokens, EOS)[0]
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    expected = (ids[:, None] == ids[None, :]) & (k <= q)
    whole = block_causal_mask(positions_of(tokens), torch.float32)
    assert whole.shape == (1, 1, 8, 8) and torch.equal(whole[0, 0] == 0, expected)
    assert torch.equal(block_causal_mask(positions_of(tokens), torch.float32, window=2)[0, 0] == 0,
                       expected & (q - k < 2))
    held = torch.tensor([0, 1, 6, 7])
    with SequenceLayout(held, 8):
        rows = block_causal_mask(positions_of(tokens)[:, held], torch.float32)
    assert rows.shape == (1, 1, 4, 8) and torch.equal(rows, whole[:, :, held])


def test_the_model_reads_nothing_back_from_the_device():
    """A forward with documents runs whole on the meta device, where any value read back to the host (as a test
    of whether the batch crosses a boundary would be) raises: on a GPU it would wait for the queued work. (The
    MoE family's forward is this one with expert layers, whose routing reads its token counts back by design.)"""
    model = load_plan(TINY + FAMILIES["llama3"], 1).build_model()
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    positions = torch.zeros(2, 32, dtype=torch.long, device="meta")
    assert model(tokens, positions=positions).shape == (2, 32, 512)


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("varlen", marks=CPU_ONLY_VARLEN)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_window_computes_each_document_alone(family, backend):
    """Logits of each document in a window of three (the first cut mid-document, as a window starting
    inside one) equal a forward of that document alone; a window without a boundary, in the same batch,
    equals the causal forward."""
    model = model_of(family, backend)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 500, (n,), generator=g) for n in (9, 13, 10)]
    docs = [torch.cat([d[:-1], torch.tensor([EOS])]) if i < 2 else d for i, d in enumerate(docs)]
    packed = torch.cat(docs)[None]
    plain = torch.randint(0, 500, (1, 32), generator=g)
    with torch.no_grad():
        batch = torch.cat([packed, plain])
        out = model(batch, positions=positions_of(batch))
        start = 0
        for d in docs:
            alone = model(d[None])[0]
            torch.testing.assert_close(out[0, start:start + len(d)], alone, rtol=1e-5, atol=1e-5)
            start += len(d)
        torch.testing.assert_close(out[1], model(plain)[0], rtol=1e-5, atol=1e-5)
        # ... and plain causal attention over the packed window is something else (the test can fail).
        assert not torch.allclose(model(packed)[0, 9:], out[0, 9:], rtol=1e-3, atol=1e-3)


@CPU_ONLY_VARLEN
@pytest.mark.parametrize("family", list(FAMILIES))
def test_varlen_computes_what_the_mask_computes(family):
    """The varlen backend (each document attended alone) gives the masked kernel's logits and every parameter's
    gradient, per tensor, up to float32 rounding, for windows of one, two and three documents, a document of one
    token included."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 500, (3, 32), generator=g)
    tokens[0, 7], tokens[0, 20], tokens[2, 30] = EOS, EOS, EOS  # window 1: one document; window 2: a 1-token one
    positions = positions_of(tokens)
    results = {}
    for backend in ("sdpa", "varlen"):
        model = model_of(family, backend).train()
        logits = model(tokens, positions=positions)
        logits.square().mean().backward()
        results[backend] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (logits, grads), (varlen_logits, varlen_grads) = results["sdpa"], results["varlen"]
    torch.testing.assert_close(varlen_logits, logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == varlen_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_what_varlen_does_not_compose_with_is_refused_naming_the_key(monkeypatch):
    from trainer import plan as plan_module
    from trainer.errors import ConfigError

    varlen = ["--model.attn_backend", "varlen"]
    with pytest.raises(ConfigError, match=r'attn_backend = "varlen" attends each document alone: it needs \[model\]'
                                          r' attn_mask_type = "block_causal"'):
        load_plan(varlen + ["--model.attn_mask_type", "causal"])
    with pytest.raises(ConfigError, match=r'attn_backend = "varlen" with \[compile\] enable: .*use attn_backend ='):
        load_plan(varlen + ["--compile.enable"])
    with pytest.raises(ConfigError, match=r"\[model.overrides\] attn_backend: set \[model\] attn_backend instead"):
        load_plan(["--model.overrides.attn_backend", "varlen"])  # the args field, past the plan's checks
    with pytest.raises(ConfigError, match=r'attn_backend = "varlen": model family tiny_gpt has only the sdpa'):
        load_plan(varlen + ["--model.modules", "tiny_gpt", "--model.name", "tiny_gpt", "--model.flavor", "tiny"])
    monkeypatch.setattr(plan_module, "device_type", lambda: "cuda")
    with pytest.raises(ConfigError, match=r'attn_backend = "varlen" on cuda: it reads each window.s document lengths'
                                          r' on the host'):
        load_plan(varlen)
    load_plan(varlen, check_memory=False)  # a dry run (it plans for no device) accepts it


def test_the_default_attention_plans_under_every_layout_and_for_every_family(caplog):
    """The default ([model] attn_mask_type = "auto") is block-causal attention under context parallelism and with
    traced pipeline stages; a family without positions runs causal attention and says so once; only an explicit
    block_causal for such a family is refused."""
    from trainer.errors import ConfigError

    assert load_plan(["--parallelism.context_parallel_degree", "2"], 2).config.model.attn_mask_type == "block_causal"
    traced = load_plan(["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_frontend",
                        "tracer", "--training.mixed_precision_param", "float32"], 2)
    assert traced.config.model.attn_mask_type == "block_causal" and traced.positions_always
    user = ["--model.modules", "tiny_gpt", "--model.name", "tiny_gpt", "--model.flavor", "tiny"]
    caplog.clear()
    assert load_plan(user).config.model.attn_mask_type == "causal"
    said = [r.getMessage() for r in caplog.records if "tiny_gpt does not take document positions" in r.getMessage()]
    assert len(said) == 1 and "attends causally across the documents packed into a window" in said[0]
    caplog.clear()
    load_plan(user + ["--model.attn_mask_type", "causal"])
    assert not any("document positions" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match=r'attn_mask_type = "block_causal": model family tiny_gpt does not take'
                                          r' document positions .*; set \[model\] attn_mask_type = "causal"'):
        load_plan(user + ["--model.attn_mask_type", "block_causal"])
    with pytest.raises(ConfigError, match=r'attn_backend = "varlen" with \[parallelism\] context_parallel_degree=2:'
                                          r' not supported'):
        load_plan(["--parallelism.context_parallel_degree", "2", "--model.attn_backend", "varlen"], 2)


@CPU_ONLY_VARLEN
def test_the_dry_run_says_which_attention_runs():
    from trainer.dry_run import describe_plan

    assert "attention block_causal (within documents)" in describe_plan(load_plan([]))
    assert "attention causal\n" in describe_plan(load_plan(["--model.attn_mask_type", "causal"]))
    assert ("attention block_causal (within documents), varlen: each document alone (CPU only)\n"
            in describe_plan(load_plan(["--model.attn_backend", "varlen"])))
