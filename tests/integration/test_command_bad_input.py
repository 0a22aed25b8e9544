"""Bad input to the commands beside training (convert, generate, measure_costs) and to the files they read (issue 65):
each case is one ``error:`` line naming the argument, key or file (and the entry inside it), exit 2, no traceback,
nothing left behind. Cases run in-process against one tiny Hugging Face folder and its converted checkpoint."""

import json
import shutil

import pytest
import torch
import transformers

from trainer import convert
from trainer import generate as gen
from trainer import measure_costs, prepare
from trainer.data.tokenizer import Tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama written by transformers (with its tokenizer), and its converted seed checkpoint."""
    root = tmp_path_factory.mktemp("bad_input")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=64, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1))
    model.save_pretrained(str(root / "hf"))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(root / "hf")
    assert convert.run(["from-hf", str(root / "hf"), str(root / "seed")]) == 0
    return root


def variant(folders, name: str, change) -> str:
    """A copy of the tiny folder with one file changed by ``change(folder)``."""
    folder = folders / name
    if not folder.exists():
        shutil.copytree(folders / "hf", folder)
        change(folder)
    return str(folder)


def edit_json(file: str, edit):
    def change(folder):
        path = folder / file
        data = json.loads(path.read_text()) if path.exists() else {}
        result = edit(data)
        path.write_text(result if isinstance(result, str) else json.dumps(result))
    return change


def deep(n: int) -> str:
    return "[" * n + "]" * n


def checkpoint_variant(folders, name: str, manifest) -> str:
    """A copy of the seed checkpoint whose checksums.json is ``manifest`` (text, or an edit of the real one)."""
    folder = folders / name
    if not folder.exists():
        shutil.copytree(folders / "seed" / "checkpoint", folder)
        from trainer.checkpoint import hash_share, merge_shares

        hash_share(folder)
        merge_shares(folder)
        real = json.loads((folder / "checksums.json").read_text())
        text = manifest if isinstance(manifest, str) else json.dumps(manifest(real))
        (folder / "checksums.json").write_text(text)
    return str(folder)


def to_hf(f, name: str, manifest) -> list[str]:
    return ["to-hf", checkpoint_variant(f, name, manifest), str(f / "o0"), "--job.config_file",
            str(f / "seed" / "model.toml")]


def shards_variant(folders, name: str, edit) -> str:
    """A copy of a small prepared dataset whose index.json is ``edit`` (text, or an edit of the real one)."""
    from trainer.data.shards import prepare_shards
    from trainer.data.tokenizer import build_tokenizer
    from trainer.config.schema import Model

    good = folders / "shards"
    if not good.exists():
        prepare_shards(iter(["one document", "and another"] * 8), build_tokenizer(Model(), 2048), good, source="t")
    folder = folders / name
    if not folder.exists():
        shutil.copytree(good, folder)
        real = json.loads((folder / "index.json").read_text())
        (folder / "index.json").write_text(edit if isinstance(edit, str) else json.dumps(edit(real)))
    return str(folder)


def shard(**change):
    return lambda d: {**d, "shards": [{**d["shards"][0], **change}]}


def gpt_oss(name: str, **change):
    """A variant whose config.json describes a gpt-oss model (the weights are never reached), with ``change``; a key
    set to None is dropped."""
    def edit(d):
        d = {**d, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 7.0,
             "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], **change}
        return {k: v for k, v in d.items() if v is not None}
    return lambda f: ["from-hf", variant(f, name, edit_json("config.json", edit)), str(f / f"o-{name}")]


def bigger_tokenizer(folder):
    Tokenizer(max_ranks=VOCAB + 100).save_hf(folder)


# The tiny folder's config.json turned into a DeepSeek-V3 one (the weights are never reached): a key of that family
# changed or removed.
DEEPSEEK = {"model_type": "deepseek_v3", "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
            "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}


def deepseek(name: str, edit: dict, n: int, words: str):
    def change(d):
        d = {**d, **DEEPSEEK, **edit}
        return {k: v for k, v in d.items() if v is not ...}  # ...: the key removed

    return (convert.run, lambda f: ["from-hf", variant(f, name, edit_json("config.json", change)), str(f / f"o{n}")],
            words)


# (command, argv builder (folders -> argv), words the error line must hold)
CASES = {
    "from-hf out below a file": (convert.run, lambda f: ["from-hf", str(f / "hf"), str(f / "hf" / "config.json" / "o")],
                                 r"from-hf OUT_FOLDER: cannot (use|create) .*config.json/o"),
    "from-hf out under /proc": (convert.run, lambda f: ["from-hf", str(f / "hf"), "/proc/nowhere/o"],
                                r"from-hf OUT_FOLDER: cannot create /proc/nowhere/o"),
    "to-hf out below a file": (convert.run, lambda f: ["to-hf", str(f / "seed" / "checkpoint"),
                                                       str(f / "hf" / "config.json" / "o"), "--job.config_file",
                                                       str(f / "seed" / "model.toml")],
                               r"to-hf OUT_FOLDER: cannot (use|create) .*config.json/o"),
    "config.json nested 100,000 deep": (
        convert.run, lambda f: ["from-hf", variant(f, "deep", edit_json("config.json", lambda d: deep(100_000))),
                                str(f / "o1")],
        r"from-hf HF_FOLDER: .*deep/config.json is not a model config \(nested 100000 deep; at most 64\)"),
    "config.json a list": (
        convert.run, lambda f: ["from-hf", variant(f, "list", edit_json("config.json", lambda d: [d])), str(f / "o2")],
        r"config.json is not a model config \(a JSON array, where an object is expected\)"),
    "config.json not UTF-8": (
        convert.run, lambda f: ["from-hf", variant(f, "latin", lambda d: (d / "config.json").write_bytes(b"\xff{}")),
                                str(f / "o3")], r"config.json is not a model config \(not UTF-8 text"),
    "tie_word_embeddings 'no'": (
        convert.run, lambda f: ["from-hf", variant(f, "tie-no", edit_json(
            "config.json", lambda d: {**d, "tie_word_embeddings": "no"})), str(f / "o4")],
        r"config.json tie_word_embeddings = 'no': must be true or false"),
    "rms_norm_eps Infinity": (
        convert.run, lambda f: ["from-hf", variant(f, "eps-inf", edit_json(
            "config.json", lambda d: json.dumps({**d, "rms_norm_eps": 1}).replace('"rms_norm_eps": 1',
                                                                                 '"rms_norm_eps": Infinity'))),
                                str(f / "o5")], r"norm_eps=inf: must be a finite number"),
    "gpt-oss layer_types entry": (convert.run, gpt_oss("oss-types", layer_types=["sliding_attention", "chunked"]),
                                  r"config.json layer_types = \['sliding_attention', 'chunked'\]: entry 'chunked' is"
                                  r" neither sliding_attention nor full_attention"),
    "gpt-oss swiglu_limit 0": (convert.run, gpt_oss("oss-limit0", swiglu_limit=0),
                               r"config.json swiglu_limit = 0: must be a finite number > 0"),
    "gpt-oss swiglu_limit a string": (convert.run, gpt_oss("oss-limit-str", swiglu_limit="7"),
                                      r"config.json swiglu_limit = '7': must be a finite number > 0"),
    "gpt-oss top-k above the experts": (convert.run, gpt_oss("oss-topk", num_experts_per_tok=5),
                                        r"config.json num_experts_per_tok = 5: must be <= num_local_experts = 4"),
    "gpt-oss no num_local_experts": (convert.run, gpt_oss("oss-experts", num_local_experts=None),
                                     r"config.json has no 'num_local_experts', which the model needs"),
    "weight_map value an int": (
        convert.run, lambda f: ["from-hf", variant(f, "index-int", edit_json(
            "model.safetensors.index.json", lambda d: {"weight_map": {"model.norm.weight": 5}})), str(f / "o6")],
        r"model.safetensors.index.json weight_map\['model.norm.weight'\] = 5: expected the name of a safetensors"),
    "tokenizer_config.json a list": (
        convert.run, lambda f: ["from-hf", variant(f, "tokcfg-list", edit_json("tokenizer_config.json",
                                                                                lambda d: [d])), str(f / "o7")],
        r"from-hf HF_FOLDER: .*tokenizer_config.json is not a tokenizer config \(a JSON array"),
    "tokenizer_config.json eos_token 5": (
        convert.run, lambda f: ["from-hf", variant(f, "tokcfg-eos", edit_json(
            "tokenizer_config.json", lambda d: {**d, "eos_token": 5})), str(f / "o8")],
        r"from-hf HF_FOLDER: .*tokenizer_config.json eos_token = 5: expected the token.s text"),
    "generation_config.json eos a string": (
        gen.run, lambda f: [variant(f, "gencfg", edit_json("generation_config.json", lambda d: {"eos_token_id": "x"})),
                            "--prompt", "x"], r"generation_config.json eos_token_id = 'x': expected a token id"),
    "tokenizer larger than the vocabulary (from-hf)": (
        convert.run, lambda f: ["from-hf", variant(f, "bigtok", bigger_tokenizer), str(f / "o9")],
        r"tokenizer.json has 6.. tokens and the model's vocabulary 512: the ids past 511 have no embedding"),
    "tokenizer larger than the vocabulary (generate)": (
        gen.run, lambda f: [variant(f, "bigtok", bigger_tokenizer), "--prompt", "x"],
        r"generate MODEL: its tokenizer has 6.. tokens and the model's vocabulary 512"),
    "prompt past the context": (
        gen.run, lambda f: [str(f / "hf"), "--prompt", "word " * 200, "--max-new-tokens", "4"],
        r"--prompt and --max-new-tokens: the prompt's .* tokens and 4 new ones make .* positions, past the model's"
        r" context of 64 \(its config.json max_position_embeddings\)"),
    "generation past the context": (
        gen.run, lambda f: [str(f / "hf"), "--prompt", "x", "--max-new-tokens", "1048576", "--no-kv-cache"],
        r"new ones make .* positions, past the model's context of 64"),
    "generate --compile.enable": (
        gen.run, lambda f: [str(f / "seed" / "checkpoint"), "--prompt", "x", "--compile.enable"],
        r"--compile.enable: generate runs the model eagerly"),
    # a checkpoint's checksums.json (read before a checkpoint is loaded: to-hf, generate, resume, initial_load_path)
    "checksums.json nested 100,000 deep": (
        convert.run, lambda f: to_hf(f, "sum-deep", deep(100_000)),
        r"is damaged: its checksums.json is unreadable \(is not a checksum manifest \(nested 100000 deep"),
    "checksums.json a list": (convert.run, lambda f: to_hf(f, "sum-list", "[]"),
                              r"checksums.json is unreadable \(is not a checksum manifest \(a JSON array"),
    "checksums.json files a string": (convert.run, lambda f: to_hf(f, "sum-files", lambda d: {**d, "files": "x"}),
                                      r"checksums.json is unreadable \(files = 'x': expected dict\)"),
    "checksums.json an entry a number": (
        convert.run, lambda f: to_hf(f, "sum-int", lambda d: {**d, "files": {".metadata": 5}}),
        r"files\['.metadata'\] = 5: expected an object"),
    "checksums.json bytes negative": (
        convert.run, lambda f: to_hf(f, "sum-neg", lambda d: {**d, "files": {
            n: {**v, "bytes": -1} for n, v in d["files"].items()}}), r"\.bytes = -1: must be between 0 and"),
    "checksums.json a name outside the folder": (
        convert.run, lambda f: to_hf(f, "sum-escape", lambda d: {**d, "files": {"../x": {"bytes": 1, "sha256": "0"}}}),
        r"files\['../x'\] \(the name\) = '../x': must be the name of a file in its folder"),
    "checksums.json another algorithm": (
        convert.run, lambda f: to_hf(f, "sum-md5", lambda d: {**d, "algorithm": "md5"}),
        r"algorithm = 'md5': only 'sha256' is written or checked"),
    # a prepared dataset's index.json (prepare --verify; training reads it the same way, tests/unit/test_shards.py)
    "index.json nested 100,000 deep": (prepare.run, lambda f: ["--verify", shards_variant(f, "ix-deep", deep(100_000))],
                                       r"--verify: .*index.json is not a trainer.token_shards index \(nested 100000"),
    "index.json a list": (prepare.run, lambda f: ["--verify", shards_variant(f, "ix-list", "[1]")],
                          r"index.json is not a trainer.token_shards index \(a JSON array"),
    "index.json a shard a number": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-shard", lambda d: {**d, "shards": [5]})], r"index.json shards\[0\] = 5: expected an object"),
    "index.json num_tokens a string": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-str", shard(num_tokens="many"))], r"shards\[0\].num_tokens = 'many': expected int"),
    "index.json num_tokens 10**30": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-huge", shard(num_tokens=10**30))], r"shards\[0\].num_tokens = 10{30}: must be between 0 and"),
    "index.json a NUL byte in a file name": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-nul", shard(tokens="a\0b"))], r"shards\[0\].tokens = 'a\\x00b': must be the name of a file in"),
    "index.json a file outside the folder": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-escape", shard(docs="../../etc/passwd"))], r"shards\[0\].docs = '../../etc/passwd': must be the"),
    "index.json a dtype not written": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-dtype", lambda d: {**d, "dtype": "object"})], r"dtype = 'object': must be 'uint16' or 'uint32'"),
    "index.json the tokenizer a string": (prepare.run, lambda f: ["--verify", shards_variant(
        f, "ix-tok", lambda d: {**d, "tokenizer": "x"})], r"index.json tokenizer = 'x': expected dict"),
    "prepare --verify of a file": (prepare.run, lambda f: ["--verify", str(f / "hf" / "config.json")],
                                   r"--verify: .*config.json is a file, not a folder prepared with"),
    "prepare into a folder below a file": (prepare.run, lambda f: [str(f / "hf" / "config.json" / "o")],
                                           r"output folder .*config.json/o: cannot create"),
    "deepseek_v3 without kv_lora_rank": deepseek("ds-kv", {"kv_lora_rank": ...}, 7,
                                                 r"config.json has no 'kv_lora_rank', which the model needs"),
    "deepseek_v3 n_group 3 of 8 experts": deepseek("ds-group", {"n_group": 3}, 7,
                                                   r"config.json n_group = 3: must divide n_routed_experts = 8"),
    "deepseek_v3 topk_group > n_group": deepseek("ds-topk", {"topk_group": 5}, 7,
                                                 r"config.json topk_group = 5: must be <= n_group = 4"),
    "deepseek_v3 scoring_func tanh": deepseek("ds-score", {"scoring_func": "tanh"}, 7,
                                              r"config.json scoring_func = 'tanh': the deepseek_v3 family computes"
                                              r" only 'sigmoid'"),
    "deepseek_v3 topk_method greedy": deepseek("ds-method", {"topk_method": "greedy"}, 7,
                                               r"config.json topk_method = 'greedy': the deepseek_v3 family computes"
                                               r" only 'noaux_tc'"),
    "measure_costs --dry-run": (
        measure_costs.run, lambda f: ["--dry-run"], r"--dry-run: a flag of train.py, not of measure_costs"),
    "measure_costs a microbatch that cannot fit": (
        measure_costs.run, lambda f: ["--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.pipeline_parallel_microbatch_size", "100000",
                                      "--training.local_batch_size", "200000", "--training.global_batch_size", "-1"],
        r"pipeline_parallel_microbatch_size=100000, \[training\] seq_len=256: timing the whole model .* needs"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_to_a_command_is_one_line(case, folders, capsys):
    import re

    command, argv, words = CASES[case]
    args = argv(folders)
    capsys.readouterr()
    assert command(args) == 2, case
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert re.search(words, lines[0]), lines[0]
    for out in [*folders.glob("o[0-9]"), *folders.glob("o-*")]:  # nothing half-written
        assert False, f"{out} was left behind"


def test_entries_a_file_reader_does_not_know_are_said(folders, caplog):
    """A checksum manifest or a shard index with an entry it does not read (misspelt, or from a newer version) is
    read, and the entry is named in one warning."""
    from trainer.checkpoint.manifest import read_manifest
    from trainer.data.shards import TokenShards

    manifest = checkpoint_variant(folders, "sum-extra", lambda d: {**d, "algorithim": "sha256"})
    index = shards_variant(folders, "ix-extra", shard(sha265="0"))
    with caplog.at_level("WARNING"):
        assert len(read_manifest(folders / "sum-extra" / "checksums.json")) > 1
        TokenShards(index)
    said = [r.getMessage() for r in caplog.records]
    assert any(manifest in m and "not read: 'algorithim'" in m for m in said), said
    assert any("in shards[0] that are not read: 'sha265'" in m for m in said), said


def test_a_balance_loss_that_is_not_imported_is_said(caplog):
    from trainer.models.decoder.hf import base_args

    config = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 4,
              "intermediate_size": 4, "router_aux_loss_coef": 0.01}
    with caplog.at_level("WARNING"):
        base_args(config, "mixtral")  # transformers trains without it unless output_router_logits: nothing to say
        assert not caplog.records
        base_args({**config, "output_router_logits": True}, "mixtral")
    assert "router_aux_loss_coef = 0.01: transformers' balance loss is not imported" in caplog.text
