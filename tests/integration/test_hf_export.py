"""Hugging Face safetensors export: the weights load in transformers and compute the same logits."""

import json

import pytest
import torch
import transformers  # noqa: E402  (the [test] extra installs it: the export must load in transformers)

from tests.conftest import load_plan
from tests.distributed.harness import PARITY, run_layout
from trainer.config import load_config
from trainer.errors import UserError
from trainer.hf import export_hf, load_hf_
from trainer.models import get_model_spec
from trainer.models.init import materialize_

SPEC = get_model_spec("llama3")
MODEL = ["--model.overrides.dim", "64", "--model.overrides.n_layers", "2", "--model.overrides.n_heads", "4",
         "--model.overrides.n_kv_heads", "2", "--model.overrides.vocab_size", "512", "--training.seq_len", "32"]


def our_model(args_list, seed=0):
    model = load_plan(args_list, 1).build_model()
    materialize_(model, torch.device("cpu"), seed)
    return model.eval()


TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    args = MODEL + (["--model.tie_embeddings"] if tied else [])
    model = our_model(args)
    export_hf([model], SPEC, model.args, tmp_path, torch.float32, pp_rank=0, pp=1, writer=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_round_trip_into_a_fresh_model(tmp_path):
    model = our_model(MODEL, seed=0)
    export_hf([model], SPEC, model.args, tmp_path, torch.float32, pp_rank=0, pp=1, writer=True)
    other = our_model(MODEL, seed=1)
    assert not torch.equal(other(TOKENS), model(TOKENS))
    load_hf_([other], SPEC, other.args, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(other(TOKENS), model(TOKENS), rtol=0, atol=0)


@pytest.mark.parametrize("damage, words", [
    ("truncate", r"model-00001-of-00001.safetensors is not a readable safetensors file \(SafetensorError"),
    ("remove", r"model-00001-of-00001.safetensors is missing \(named by model.safetensors.index.json for"),
    ("index", r"model.safetensors.index.json is not a safetensors index"),
])
def test_a_damaged_hugging_face_folder_is_one_line_naming_the_file(tmp_path, damage, words):
    model = our_model(MODEL)
    export_hf([model], SPEC, model.args, tmp_path, torch.float32, pp_rank=0, pp=1, writer=True)
    weights = tmp_path / "model-00001-of-00001.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:5])
    elif damage == "remove":
        weights.unlink()
    else:
        (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(UserError, match=r"\[checkpoint\] initial_load_path: .*" + words):
        load_hf_([our_model(MODEL, seed=1)], SPEC, model.args, tmp_path)


@pytest.mark.slow
def test_pipelined_export_writes_one_file_per_stage_rank(tmp_path):
    """PP2 training exports two files; transformers and a one-process model built from them agree."""
    args = ["--training.local_batch_size", "8", "--model.overrides.n_layers", "4",
            "--parallelism.pipeline_parallel_degree", "2", "--checkpoint.export_hf"]
    run_layout(2, args + ["--job.dump_folder", str(tmp_path)], tmp_path)
    folder = tmp_path / "checkpoint" / "hf-step-3"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    # total_size counts every file's tensors, not one pipeline rank's
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert index["metadata"]["total_size"] == total
    ours = our_model(PARITY + ["--model.overrides.n_layers", "4"], seed=5)
    load_hf_([ours], SPEC, ours.args, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS), rtol=1e-4, atol=1e-5)
    # ... and a run can start from it.
    start = load_config(overrides=PARITY + ["--model.overrides.n_layers", "4", "--training.local_batch_size", "8",
                                            "--checkpoint.initial_load_path", str(folder),
                                            "--job.dump_folder", str(tmp_path / "warm")])
    from trainer.train import main

    assert main(start).losses[0] < 6.7  # the exported weights were trained; a fresh init starts at 6.77
