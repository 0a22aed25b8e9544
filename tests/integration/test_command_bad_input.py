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
from trainer import measure_costs
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
    "weight_map value an int": (
        convert.run, lambda f: ["from-hf", variant(f, "index-int", edit_json(
            "model.safetensors.index.json", lambda d: {"weight_map": {"model.norm.weight": 5}})), str(f / "o6")],
        r"model.safetensors.index.json weight_map\['model.norm.weight'\] = 5: expected the name of a safetensors"),
    "tokenizer_config.json a list": (
        convert.run, lambda f: ["from-hf", variant(f, "tokcfg-list", edit_json("tokenizer_config.json",
                                                                                lambda d: [d])), str(f / "o7")],
        r"tokenizer_config.json is not a tokenizer config \(a JSON array"),
    "tokenizer_config.json eos_token 5": (
        convert.run, lambda f: ["from-hf", variant(f, "tokcfg-eos", edit_json(
            "tokenizer_config.json", lambda d: {**d, "eos_token": 5})), str(f / "o8")],
        r"tokenizer_config.json eos_token = 5: expected the token's text"),
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
    for out in folders.glob("o[0-9]"):  # nothing half-written
        assert False, f"{out} was left behind"
