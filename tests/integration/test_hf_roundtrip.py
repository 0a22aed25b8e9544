"""Hugging Face round trip (issue 28): from-hf -> train -> to-hf -> transformers, tokenizer export, generation."""

import json
import logging
import re
import shutil

import pytest
import torch
import transformers

from trainer import convert
from trainer import generate as gen
from trainer.config import load_config
from trainer.convert import load_checkpoint, load_hf
from trainer.data.sources import bundled_documents
from trainer.data.tokenizer import HFTokenizer, Tokenizer
from trainer.train import main

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
             bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, initializer_range=0.2)
FAMILIES = {
    # intermediate_size 96 is no rounding of 8/3 * 64 = 170: the converter must find multiple_of/ffn_dim_multiplier
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **SMALL)),
    "moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        head_dim=16, mlp_only_layers=[0], **SMALL)),
}
PROMPT = "def fibonacci(n):\n    "


def hf_folder(path, family: str):
    """A random tiny model written by transformers, with the bundled tokenizer cut to its vocabulary."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # norms away from 1, so that a wrong layout of a norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(str(path))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(path)
    return model


def logits_of(model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return (out.logits if hasattr(out, "logits") else out)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_train_to_hf_and_generate_like_transformers(tmp_path, family, capsys):
    source = hf_folder(tmp_path / "hf", family)
    assert convert.run(["from-hf", str(tmp_path / "hf"), str(tmp_path / "seed")]) == 0
    toml = (tmp_path / "seed" / "model.toml").read_text()
    assert f'name = "{family}"' in toml and "initial_load_path" in toml and "tokenizer_path" in toml

    # The seed computes transformers' logits (the import alone).
    tok = HFTokenizer(tmp_path / "seed" / "tokenizer.json")
    ids = tok.encode(PROMPT, bos=True)
    seed = load_checkpoint(tmp_path / "seed" / "checkpoint",
                           ["--job.config_file", str(tmp_path / "seed" / "model.toml")],
                           key="test")
    torch.testing.assert_close(logits_of(seed.model, ids), logits_of(source, ids), rtol=1e-5, atol=1e-5)

    # One training step from it, then out to Hugging Face again.
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{tmp_path / "seed" / "model.toml"}"\n[training]\nsteps = 1\nseq_len = 32\n'
                   f'local_batch_size = 2\nmixed_precision_param = "float32"\n[checkpoint]\nenable = true\n'
                   f'[metrics]\nenable_tensorboard = false\n[job]\ndump_folder = "{tmp_path / "run"}"\n')
    assert main(load_config(job)).losses
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert convert.run(["to-hf", str(step), str(tmp_path / "out")]) == 0
    # trained at 32 positions, the model keeps the context its config.json gave it
    assert json.loads((tmp_path / "out" / "config.json").read_text())["max_position_embeddings"] == (
        json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"]) > 32
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf_tok(PROMPT).input_ids == ids  # begin-of-text first, as our prompts and documents
    ours = load_checkpoint(step, [], key="test", seq_len=64)
    trained = logits_of(ours.model, ids)
    assert not torch.allclose(trained, logits_of(seed.model, ids))  # the step changed the weights
    torch.testing.assert_close(logits_of(hf, ids), trained, rtol=1e-5, atol=1e-5)

    # Greedy generation: the same 20 tokens as transformers', with and without our KV cache.
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    cached = gen.generate(ours.model, ids, max_new_tokens=20, eos_id=tok.eos_id)
    uncached = gen.generate(ours.model, ids, max_new_tokens=20, eos_id=tok.eos_id, kv_cache=False)
    assert cached == theirs == uncached and len(cached) == 20
    # Sampling draws the same tokens with and without the cache too.
    kw = dict(max_new_tokens=20, eos_id=None, temperature=1.0, top_k=50, top_p=0.9, seed=3)
    assert gen.generate(ours.model, ids, **kw) == gen.generate(ours.model, ids, kv_cache=False, **kw)

    # A checkpoint loaded into another model shape is one line (DCP's CheckpointException is a BaseException).
    capsys.readouterr()
    kv = "--model.overrides.n_kv_heads" if family == "llama3" else "--model.overrides.head_dim_override"
    assert convert.run(["to-hf", str(step), str(tmp_path / "other"), kv, "1" if family == "llama3" else "8"]) == 2
    assert re.search(r"(?m)^error: to-hf CHECKPOINT_STEP_FOLDER: cannot load .*step-1 into .*another model shape",
                     capsys.readouterr().err)

    # The command line: the exported folder and the checkpoint generate the same text.
    capsys.readouterr()
    assert gen.run([str(tmp_path / "out"), "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
    from_hf_folder = capsys.readouterr().out
    assert gen.run([str(step), "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
    assert (capsys.readouterr().out == from_hf_folder
            == PROMPT + tok.decode([i for i in cached if i != tok.eos_id]) + "\n")


def test_the_exported_tiktoken_tokenizer_encodes_every_bundled_document_identically(tmp_path):
    ours = Tokenizer(max_ranks=2046)  # the debug model's
    ours.save_hf(tmp_path)
    theirs = HFTokenizer(tmp_path / "tokenizer.json")
    docs = bundled_documents()
    assert ours.encode_documents(docs) == theirs.encode_documents(docs)
    assert (theirs.bos_id, theirs.eos_id, theirs.vocab_size) == (ours.bos_id, ours.eos_id, ours.vocab_size)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto(docs[0]).input_ids == ours.encode(docs[0], bos=True) and auto.eos_token_id == ours.eos_id
    quoting = "a document that quotes <|end_of_text|> and <|begin_of_text|> goes on"
    assert auto(quoting).input_ids == ours.encode(quoting, bos=True) == theirs.encode(quoting, bos=True)


def test_the_whole_bundled_tokenizer_exports_identically_on_hard_text(tmp_path):
    ours = Tokenizer()  # all 100k ranks of cl100k_base
    ours.save_hf(tmp_path)
    theirs = HFTokenizer(tmp_path / "tokenizer.json")
    texts = [d[:3000] for d in bundled_documents()[:10]] + [
        "  leading spaces\tand\ttabs\r\n\r\nCRLF", "ünïcödé 日本語テキスト 🙂🙂 émoji", "1234567890 3.14159 -42",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "<|end_of_text|> is text here", "'s 't 're 've 'm 'll 'd WE'LL",
        "\x00\x01\x7f"]
    for text in texts:
        assert theirs.encode(text) == ours.encode(text), text[:40]
        assert theirs.decode(theirs.encode(text)) == text


def test_sampling_keeps_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    drawn = {int(gen.sample_next(logits, temperature=1.0, top_k=2, top_p=1.0,
                                 generator=torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert drawn == {0, 1}
    # softmax(4, 3, 2, 1, 0) = 0.636, 0.234, 0.086, ...: top_p 0.8 keeps the two whose mass reaches it
    drawn = {int(gen.sample_next(logits, temperature=1.0, top_k=0, top_p=0.8,
                                 generator=torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert drawn == {0, 1}
    assert int(gen.sample_next(logits, temperature=0.0, top_k=0, top_p=1.0, generator=None)) == 0


def test_an_imported_config_json_is_adopted_and_a_conflicting_override_said(tmp_path, caplog):
    """initial_load_path on a Hugging Face folder: [model] takes config.json's shape; an override that differs
    is used and named in one warning; another family is refused, naming the right one."""
    from tests.conftest import load_plan

    caplog.set_level(logging.INFO)
    hf_folder(tmp_path, "llama3")
    start = ["--checkpoint.initial_load_path", str(tmp_path)]
    plan = load_plan(start, 1)  # the debug flavor as configured: dim 256, 6 layers
    a = plan.model_args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.ffn_hidden_dim, a.rope_theta, a.norm_eps) == (
        64, 2, 4, 2, VOCAB, 96, 10000.0, 1e-6)
    assert "takes its shape from" in caplog.text and "dim=64" in caplog.text
    # A tied flavor (1B) with an untied folder: the model stays untied, as config.json says.
    assert load_plan(start + ["--model.flavor", "1B"], 1).model_args.tie_embeddings is False
    plan = load_plan(start + ["--model.overrides.rope_theta", "500000"], 1)
    assert plan.model_args.rope_theta == 500000.0
    assert re.search(r"WARNING .*\[model.overrides\] set other values than .*config.json.*: rope_theta=500000(\.0)?"
                     r" \(config.json: 10000.0\)", caplog.text)
    from trainer.errors import UserError

    with pytest.raises(UserError, match=r"\[model\] name = 'moe': .* holds a llama model, which is family 'llama3';"
                                        r" set \[model\] name = 'llama3'"):
        load_plan(start + ["--model.name", "moe"], 1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    a = load_plan(start, 1).model_args  # Llama 3.1's scaling is computed (tests/integration/test_families.py)
    assert (a.rope_scaling, a.rope_factor, a.rope_theta) == ("llama3", 8.0, 500000.0)
    config["rope_parameters"] = {"rope_type": "longrope", "factor": 8.0, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"config.json rope_parameters = .*: rope_type 'longrope' is not supported"):
        load_plan(start, 1)


def test_transformers_4_and_5_config_files_describe_the_same_model():
    """transformers 5 writes rope_parameters and num_local_experts; 4 wrote rope_theta, rope_scaling and num_experts."""
    from trainer.models import get_model_spec

    for family, v5 in FAMILIES.items():
        config = v5().config.to_dict()
        v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "num_local_experts")}
        v4.update(rope_theta=config["rope_parameters"]["rope_theta"], rope_scaling=None)
        if family == "moe":
            v4["num_experts"] = config["num_local_experts"]
        spec = get_model_spec(family)
        base = next(iter(spec.flavors.values()))
        assert spec.hf.from_config(v4, base) == spec.hf.from_config(config, base), family


def test_generation_in_bfloat16_and_stopping_at_generation_config_ids(tmp_path, capsys):
    hf_folder(tmp_path, "llama3")
    assert gen.run([str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "4", "--dtype", "bfloat16"]) == 0
    model = load_hf(tmp_path, key="test", seq_len=64).model
    ids = HFTokenizer(tmp_path / "tokenizer.json").encode(PROMPT, bos=True)
    free = gen.generate(model, ids, max_new_tokens=12, eos_id=None)
    stop = free[5]
    assert gen.generate(model, ids, max_new_tokens=12, eos_id=None, stop_ids=(stop,)) == free[:free.index(stop) + 1]


def test_converter_and_generator_errors_are_one_line(tmp_path, capsys):
    hf_folder(tmp_path / "hf", "llama3")
    for name, change in (("gelu", {"hidden_act": "gelu"}), ("zero-heads", {"num_attention_heads": 0}),
                         ("text-size", {"hidden_size": "64"}), ("no-vocab", {"vocab_size": None})):
        shutil.copytree(tmp_path / "hf", tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
    shutil.copytree(tmp_path / "hf", tmp_path / "no-weights")  # ... but one tensor short
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "no-weights" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "model.layers.1.mlp.down_proj.weight"}, weights)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [
        (convert.run, ["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "o")], r"folder not found"),
        (convert.run, ["to-hf", str(tmp_path / "hf"), str(tmp_path / "o")], r"is not a checkpoint step folder"),
        (convert.run, ["from-hf", str(tmp_path / "hf"), str(tmp_path / "full")], r"exists and is not an empty folder"),
        (convert.run, ["to-hf", str(tmp_path / "hf"), str(tmp_path / "full" / "x")], r"x exists and is not an empty"),
        (convert.run, ["from-hf", str(tmp_path / "no-weights"), str(tmp_path / "o")],
         r"from-hf HF_FOLDER: .*no-weights has no tensor 'model.layers.1.mlp.down_proj.weight'"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--device", "cuda:7"], r"--device cuda:7: not usable here"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--device", "meta"], r"--device meta: use cpu, cuda"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--temperature", "1e-40"], r"must be 0 \(greedy\) or in"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--seed", str(2**80)], r"--seed .*: must be in 0 .."),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--max-new-tokens", "1000000000"], r"must be in 1 .."),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--logits", str(tmp_path / "no" / "l.pt")],
         r"--logits .*l.pt: cannot write it"),
        (convert.run, ["from-hf", str(tmp_path / "gelu"), str(tmp_path / "o")],
         r"from-hf HF_FOLDER: .*gelu/config.json hidden_act = 'gelu': the llama3 family computes only 'silu'"),
        (convert.run, ["from-hf", str(tmp_path / "zero-heads"), str(tmp_path / "o")],
         r"from-hf HF_FOLDER: .*config.json describes a model llama3 cannot build: \[model.overrides\] n_heads=0"),
        (convert.run, ["from-hf", str(tmp_path / "text-size"), str(tmp_path / "o")],
         r"from-hf HF_FOLDER: .*config.json (is not a valid llama config|describes a model llama3 cannot build)"),
        (convert.run, ["from-hf", str(tmp_path / "no-vocab"), str(tmp_path / "o")],
         r"from-hf HF_FOLDER: .*config.json describes a model llama3 cannot build"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--max-new-tokens", "many"], r"invalid int value: 'many'"),
        (gen.run, [str(tmp_path / "hf"), "--prompt-file", str(tmp_path / "none.txt")], r"--prompt-file .*none.txt:"
                                                                                       r" cannot read it"),
        (convert.run, ["from-hf", str(tmp_path / "full"), str(tmp_path / "o")], r"is not a Hugging Face model folder"),
        (convert.run, ["sideways", "a", "b"], r"invalid choice: 'sideways'"),
        (gen.run, [str(tmp_path / "hf")], r"give the prompt with --prompt TEXT or --prompt-file FILE"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]"),
        (gen.run, [str(tmp_path / "hf"), "--prompt", "x", "--training.steps", "3"], r"is a Hugging Face folder"),
    ]
    for command, argv, words in cases:
        capsys.readouterr()
        assert command(argv) == 2, argv
        err = capsys.readouterr().err
        assert any(line.startswith("error: ") for line in err.splitlines()) and "Traceback" not in err, err
        assert re.search(words, err), err


def test_a_prompt_fed_in_chunks_through_the_kv_cache_computes_the_whole_forward():
    """Later positions attend to the cached ones and causally among themselves (the cache's mask)."""
    from tests.conftest import load_plan
    from trainer.models.init import materialize_
    from trainer.models.decoder.model import Attention, KVCache

    model = load_plan(["--model.overrides.n_layers", "2", "--training.seq_len", "32"], 1).build_model()
    materialize_(model, torch.device("cpu"), seed=0)
    ids = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        for m in model.modules():
            if isinstance(m, Attention):
                m.kv_cache = KVCache(1, 32, m.wk.out_features // m.head_dim, m.head_dim, dtype=torch.float32,
                                     device=torch.device("cpu"))
        chunks = torch.cat([model(ids[:, :7]), model(ids[:, 7:8]), model(ids[:, 8:])], dim=1)
    torch.testing.assert_close(chunks, whole, rtol=1e-5, atol=1e-5)
