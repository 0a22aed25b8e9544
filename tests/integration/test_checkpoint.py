"""Checkpoints: exact resume, resume on another layout, atomic saves under kill -9, retention, errors."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import trainer.checkpoint as ckpt
from tests.distributed.harness import ENV, P, PARITY, REPO, Launches, run_layout, runs
from tests.parity import REPORT, compare, record
from trainer.checkpoint import complete_steps
from trainer.config import load_config
from trainer.errors import UserError
from trainer.train import main

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "100"]


def after_step_3(result: dict) -> dict:
    """Steps 4-6 of a straight run of 6 steps, every gradient and the final parameters: what a resume must reproduce."""
    return {k: v for k, v in result["tensors"].items() if k.startswith(("grad/4/", "grad/5/", "grad/6/", "param/"))}


def assert_resumes_bit_for_bit(resumed: dict, straight: dict) -> None:
    """A resume from step 3 on the straight run's layout: its losses and every tensor of steps 4-6, exactly."""
    assert resumed["losses"] == straight["losses"][3:]
    same = compare(resumed["tensors"], after_step_3(straight), rtol=0.0, floor=0.0)
    assert same.ok, same.failures[:10]


def train(args, dump):
    return main(load_config(overrides=PARITY + args + ["--job.dump_folder", str(dump)]))


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_exact_resume_single_process(tmp_path, async_mode, caplog):
    """On CUDA (TRAINER_TEST_DEVICE=cuda) async_with_pinned_mem stages through pinned host buffers; on CPU it says
    that it saves as 'async'."""
    args = ["--training.local_batch_size", "8", "--training.steps", "8", "--checkpoint.async_mode", async_mode,
            "--checkpoint.enable", "--checkpoint.interval", "2"]
    straight = train(args, tmp_path / "straight")
    first = train(args + ["--training.stop_at_step", "4"], tmp_path / "resumed")
    assert complete_steps(tmp_path / "resumed" / "checkpoint") == [2, 4]
    second = train(args, tmp_path / "resumed")
    assert first.losses == straight.losses[:4]
    # Bit for bit: same layout, so every number after the resume is identical.
    assert second.losses == straight.losses[4:] and second.grad_norms == straight.grad_norms[4:]
    # Each long phase says when it starts and how long it took (a start line, an end line: no flood).
    import re

    log = caplog.text
    assert re.search(r"checkpoint step-2: saving \d+\.\d\d GiB \(this rank's share\)", log)
    assert re.search(r"checkpoint saved: .*step-2 \(\d+\.\d s\)", log)
    assert re.search(r"loading checkpoint .*step-4\n", log)
    assert re.search(r"resumed from .*step-4 \(model, .*\) in \d+\.\d s", log)
    pinned_fallback = "async_with_pinned_mem' needs CUDA; saving in the background from ordinary host memory"
    assert (pinned_fallback in log) == (async_mode == "async_with_pinned_mem" and not torch.cuda.is_available())
    pinned = "in the background through pinned host buffers" in log
    assert pinned == (async_mode == "async_with_pinned_mem" and torch.cuda.is_available())


@pytest.mark.slow
def test_exact_resume_pp2_fsdp2_zbv_and_on_another_layout(tmp_path, caplog):
    layout = ["--model.overrides.n_layers", "4", P + "pipeline_parallel_degree", "2", P + "data_parallel_shard_degree",
              "2", P + "pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "4",
              "--training.steps", "6", *CKPT]
    # Saved at step 3 too: the resumes below start from a copy of that checkpoint (a launch stopped at step 3 saves
    # the same, as test_exact_resume_single_process checks).
    straight = run_layout(4, layout + ["--checkpoint.interval", "3", "--job.dump_folder", str(tmp_path / "straight")],
                          tmp_path)
    # Its final checkpoint converts to Hugging Face in one process (issue 28): the weights are the 4-rank run's
    # final parameters, bit for bit.
    from trainer.convert import load_hf, run as convert

    assert convert(["to-hf", str(tmp_path / "straight" / "checkpoint" / "step-6"), str(tmp_path / "hf")]) == 0
    exported = load_hf(tmp_path / "hf", key="test", seq_len=32).model
    for name, param in exported.named_parameters():
        assert torch.equal(param, straight["tensors"][f"param/{name}"][0]), name
    # A newer checkpoint with one bit flipped in a file that rank 3 verifies (files are shared out
    # in name order: .metadata, __0_0, __1_0, __2_0, ...): every rank must agree to fall back to step 3.
    folder = tmp_path / "r" / "checkpoint"
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", folder / "step-3")
    shutil.copytree(folder / "step-3", folder / "step-4")
    _flip_bit(folder / "step-4" / "__2_0.distcp")
    resumed = run_layout(4, layout + ["--job.dump_folder", str(tmp_path / "r")], tmp_path)
    assert (folder / "step-4.damaged").is_dir() and complete_steps(folder) == [3, 6]
    assert resumed["grad_norms"] == straight["grad_norms"][3:]
    assert_resumes_bit_for_bit(resumed, straight)
    # The step-3 checkpoint of PP2 x FSDP2 (4 ranks) resumed by one process: DCP reshards.
    single, tensors = record(load_config(overrides=PARITY + [
        "--model.overrides.n_layers", "4", "--training.local_batch_size", "8", "--training.steps", "6", *CKPT,
        "--checkpoint.load_step", "3", "--job.dump_folder", str(tmp_path / "r")]))
    # Four ranks' generator states do not map onto one: they start fresh, said once, and rng is not listed as restored.
    assert ("holds the random generator states of 4 ranks and this run has 1; random generators start fresh"
            in caplog.text)
    resumed_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert "rng" not in resumed_line and "model" in resumed_line
    assert single.losses == pytest.approx(straight["losses"][3:], rel=1e-5)
    assert single.grad_norms == pytest.approx(straight["grad_norms"][3:], rel=1e-5)
    other_layout = compare(tensors, after_step_3(straight))
    REPORT.append(f"{'resume PP2xFSDP2 -> 1 process':<34} worst {other_layout.worst_rel:.2e}  {other_layout.worst_key}")
    assert other_layout.ok, other_layout.failures[:10]


DDP = [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "1"]
RESUMES = {  # test -> its straight run (saves at step 3 of 6) and the runs that resume from that step-3 checkpoint
    "test_exact_resume_under_plain_ddp_and_on_fsdp": (
        ["--training.local_batch_size", "4", "--training.steps", "6", *CKPT, "--checkpoint.interval", "3"],
        {"ddp": DDP, "fsdp": [P + "data_parallel_shard_degree", "2"]}, DDP),
    "test_exact_resume_under_cp2_and_on_one_process": (
        ["--training.local_batch_size", "8", "--training.steps", "6", *CKPT, "--checkpoint.interval", "3"],
        {"cp2": [P + "context_parallel_degree", "2"]}, [P + "context_parallel_degree", "2"]),
}
STEP3 = ["--checkpoint.load_step", "3"]


@pytest.fixture(scope="module")
def resumes(request, tmp_path_factory):
    """The 2-rank runs of the selected tests below in one shared launch: each test's straight run, then the runs
    that resume from its step-3 checkpoint (in the straight run's folder, where they also save)."""
    launches = Launches(tmp_path_factory.mktemp("resumes"), {})
    for test, (common, resumed, straight) in RESUMES.items():
        if runs(request, test):
            launches.cases[f"{test}-straight"] = (2, [*PARITY, *straight, *common])
            step3 = ["--checkpoint.folder", str(launches.dump(f"{test}-straight") / "checkpoint"), *STEP3]
            for name, layout in resumed.items():
                launches.cases[f"{test}-{name}"] = (2, [*PARITY, *layout, *common, *step3])
    return launches


@pytest.mark.slow
def test_exact_resume_under_plain_ddp_and_on_fsdp(resumes, tmp_path):
    """Plain DDP runs on torch's DDP reducer (plain tensors, not FSDP's DTensors): its checkpoint resumes bit for bit
    on DDP and, resharded by DCP, on FSDP2."""
    test = "test_exact_resume_under_plain_ddp_and_on_fsdp"
    straight = resumes.result(f"{test}-straight", tmp_path)
    assert_resumes_bit_for_bit(resumes.result(f"{test}-ddp", tmp_path), straight)
    resumed = resumes.result(f"{test}-fsdp", tmp_path)
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-5)
    other = compare(resumed["tensors"], after_step_3(straight))
    REPORT.append(f"{'resume DDP2 -> FSDP2':<34} worst {other.worst_rel:.2e}  {other.worst_key}")
    assert other.ok, other.failures[:10]


@pytest.mark.slow
def test_exact_resume_under_cp2_and_on_one_process(resumes, tmp_path):
    test = "test_exact_resume_under_cp2_and_on_one_process"
    straight = resumes.result(f"{test}-straight", tmp_path)
    assert_resumes_bit_for_bit(resumes.result(f"{test}-cp2", tmp_path), straight)
    single, tensors = record(load_config(overrides=PARITY + RESUMES[test][0] + STEP3 + [
        "--checkpoint.folder", str(straight["dump"] / "checkpoint"), "--job.dump_folder", str(tmp_path / "r")]))
    assert single.losses == pytest.approx(straight["losses"][3:], rel=1e-5)
    other_layout = compare(tensors, after_step_3(straight))
    REPORT.append(f"{'resume CP2 -> 1 process':<34} worst {other_layout.worst_rel:.2e}  {other_layout.worst_key}")
    assert other_layout.ok, other_layout.failures[:10]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, mode):
    args = PARITY + ["--training.local_batch_size", "8", "--training.steps", "6", "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--checkpoint.async_mode",
                     "async" if mode == "async" else "disabled",
                     "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "integration" / "crash_worker.py"), mode, "4", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    folder = tmp_path / "run" / "checkpoint"
    assert complete_steps(folder) == [2]  # step 4 never became visible
    assert (folder / "step-4.tmp").exists()
    resumed = main(load_config(overrides=args))
    straight = main(load_config(overrides=args[:-1] + [str(tmp_path / "straight")]))
    assert resumed.losses == straight.losses[2:]  # continued exactly from step 2


def test_retention_and_model_only_final_export(tmp_path):
    args = ["--training.local_batch_size", "8", "--training.steps", "5", "--checkpoint.enable", "--checkpoint.interval",
            "1", "--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only",
            "--checkpoint.export_dtype", "bfloat16"]
    train(args, tmp_path)
    folder = tmp_path / "checkpoint"
    assert complete_steps(folder) == [4, 5]
    weights = FileSystemReader(str(folder / "model-step-5")).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in weights} == {"model"}
    assert all(m.properties.dtype == torch.bfloat16 for m in weights.values())
    for step in (4, 5):  # the final step is a full, resumable checkpoint too
        full = FileSystemReader(str(folder / f"step-{step}")).read_metadata().state_dict_metadata
        assert {k.split(".")[0] for k in full} == {"model", "optimizer", "dataloader", "train_state", "rng"}
    # The weights-only save converts to Hugging Face like the full one: its bf16 weights are the full one's, rounded.
    from safetensors.torch import load_file

    from trainer.convert import run as convert

    assert convert(["to-hf", str(folder / "model-step-5"), str(tmp_path / "hf-weights")]) == 0
    assert convert(["to-hf", str(folder / "step-5"), str(tmp_path / "hf-full"), "--dtype", "bfloat16"]) == 0
    weights_only = load_file(tmp_path / "hf-weights" / "model-00001-of-00001.safetensors")
    full = load_file(tmp_path / "hf-full" / "model-00001-of-00001.safetensors")
    assert weights_only.keys() == full.keys()
    assert all(torch.equal(weights_only[k], full[k].float()) for k in full)


def test_continuing_a_finished_run_resumes_its_full_state(tmp_path):
    # A constant LR after warm-up (decay_ratio 0) makes a 4-step run the first 4 steps of a 6-step one.
    args = ["--training.local_batch_size", "8", "--lr_scheduler.decay_ratio", "0", *CKPT]
    straight = train(args + ["--training.steps", "6"], tmp_path / "straight")
    finished = train(args + ["--training.steps", "4"], tmp_path / "run")  # final save with last_save_model_only
    assert finished.losses == straight.losses[:4]
    # re-running a finished job trains nothing; with export_hf it exports the final weights (issue 28)
    again = train(args + ["--training.steps", "4", "--checkpoint.export_hf"], tmp_path / "run")
    assert again.losses == []
    assert {p.name for p in (tmp_path / "run" / "checkpoint" / "hf-step-4").iterdir()} >= {
        "config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"}
    more = train(args + ["--training.steps", "6"], tmp_path / "run")  # raising steps continues from step 5
    assert more.losses == straight.losses[4:] and more.lrs == straight.lrs[4:]


def test_weights_only_step_folder_is_never_resumed(tmp_path):
    args = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(args + ["--training.stop_at_step", "2"], tmp_path)
    # What an older version wrote at the final step: weights only, under a step name.
    dcp.save({"model": {"x": torch.zeros(1)}}, checkpoint_id=str(tmp_path / "checkpoint" / "step-3"))
    with pytest.raises(UserError, match="load_step=3: .*step-3 holds model weights only .*initial_load_path"):
        train(args + ["--checkpoint.load_step", "3"], tmp_path)
    resumed = train(args, tmp_path)  # the newest full checkpoint (step 2) continues the run
    assert len(resumed.losses) == 2


def test_excluding_train_state_restarts_the_step_and_the_lr_schedule_together(tmp_path):
    args = ["--training.local_batch_size", "8", "--training.steps", "6", *CKPT]
    fresh = train(args, tmp_path / "fresh")
    train(args + ["--training.stop_at_step", "4"], tmp_path / "run")
    restarted = train(args + ["--checkpoint.exclude_from_loading", "train_state"], tmp_path / "run")
    # Steps 1..6 again on the resumed weights: the LR follows the step counter, never below zero.
    assert restarted.lrs == fresh.lrs and min(restarted.lrs) > 0
    with pytest.raises(UserError, match="'lr_scheduler' is not a separate part.*exclude 'train_state'"):
        load_config(overrides=args + ["--checkpoint.exclude_from_loading", "lr_scheduler"])


def test_initial_load_path_and_exclusions(tmp_path, caplog):
    base = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(base + ["--training.stop_at_step", "2"], tmp_path / "src")
    src = tmp_path / "src" / "checkpoint" / "step-2"
    # A new run starting from those weights: same step-1 forward as the source run's step 3 would
    # see with fresh optimizer and data, i.e. a loss different from a fresh init.
    fresh = train(base, tmp_path / "fresh")
    warm = train(base + ["--checkpoint.initial_load_path", str(src)], tmp_path / "warm")
    assert warm.losses[0] < fresh.losses[0]
    assert "is not used: the run resumes its own checkpoint" not in caplog.text
    # The run's own checkpoint wins over initial_load_path once it has one, and says so.
    train(base + ["--checkpoint.initial_load_path", str(src), "--checkpoint.load_step", "4"], tmp_path / "warm")
    assert f"initial_load_path {src} is not used: the run resumes its own checkpoint" in caplog.text
    # Excluding the data position replays the stream from the start on resumed weights: same
    # weights and step as a normal resume, different batches, so different losses.
    kept = train(base + ["--checkpoint.load_step", "2"], tmp_path / "src")
    excl = train(base + ["--checkpoint.load_step", "2", "--checkpoint.exclude_from_loading", "dataloader"],
                 tmp_path / "src")
    assert len(excl.losses) == len(kept.losses) == 2
    assert excl.losses[0] != kept.losses[0]


def test_checkpoint_errors(tmp_path):
    base = ["--training.local_batch_size", "8", "--training.steps", "2", *CKPT]
    with pytest.raises(UserError, match=r"load_step=7: no complete checkpoint .*step-7 \(available: none\)"):
        train(base + ["--checkpoint.load_step", "7"], tmp_path / "a")
    train(base, tmp_path / "b")
    with pytest.raises(UserError, match="exclude_from_loading: unknown part 'optimiser'"):
        load_config(overrides=base + ["--checkpoint.exclude_from_loading", "optimiser"])
    # A different model shape: one line naming the checkpoint.
    with pytest.raises(UserError, match=r"cannot load .*step-2 into this model .*another model shape"):
        train(base + ["--model.overrides.dim", "128", "--checkpoint.load_step", "2",
                      "--checkpoint.no-last_save_model_only"], tmp_path / "b")
    # A corrupt checkpoint: the metadata file is garbage.
    corrupt = tmp_path / "c" / "checkpoint" / "step-1"
    corrupt.mkdir(parents=True)
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"\[checkpoint\] .*step-1 is not a readable checkpoint"):
        train(base, tmp_path / "c")


def test_resume_into_a_model_with_fewer_layers_names_the_dropped_tensors(tmp_path, caplog):
    """Saved with 3 blocks, resumed with 2: block 2's tensors have nowhere to go. That is an error naming them,
    unless [checkpoint] exclude_from_loading leaves them behind by name; excluding tensors the model has is refused."""
    base = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(base + ["--model.overrides.n_layers", "3", "--training.stop_at_step", "2"], tmp_path)
    fewer = base + ["--model.overrides.n_layers", "2", "--checkpoint.load_step", "2"]
    with pytest.raises(UserError, match=r"step-2 holds \d+ model tensors this model lacks \(layers\.2\.\*\);.*"
                                        r"exclude_from_loading = \['model\.layers\.2'\]"):
        train(fewer, tmp_path)
    with pytest.raises(UserError, match=r"'model\.layers\.1' names tensors this model has"):
        train(fewer + ["--checkpoint.exclude_from_loading", "model.layers.1"], tmp_path)
    left = train(fewer + ["--checkpoint.exclude_from_loading", "model.layers.2,model.layers.9"], tmp_path)
    assert "exclude_from_loading: 'model.layers.9' names no tensor of" in caplog.text  # a typo is said
    assert "'model.layers.2' names no tensor" not in caplog.text
    # Blocks 0 and 1 come from the checkpoint: the resumed loss is the trained model's, below a fresh 2-block start.
    fresh = train(["--training.local_batch_size", "8", "--training.steps", "2", "--model.overrides.n_layers", "2"],
                  tmp_path / "fresh")
    assert len(left.losses) == 2 and left.losses[0] < fresh.losses[0]


def test_resume_keeps_the_saved_global_batch_and_tokenizer(tmp_path, caplog):
    """Saved at a global batch of 8 sequences. A resume whose batch is derived from its layout
    (global_batch_size = -1) and would be 4 stops with one line naming the key; the saved batch set
    explicitly on a narrower layout continues exactly (2 accumulation steps of 4); another batch set
    explicitly is taken, with a warning."""
    args = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    straight = train(args, tmp_path / "straight")
    train(args + ["--training.stop_at_step", "2"], tmp_path)
    derived = ["--training.local_batch_size", "4", "--training.global_batch_size", "-1"]
    with pytest.raises(UserError, match=r"\[training\] global_batch_size: .*step-2 was trained with a global batch of 8"
                                        r" sequences; this run's would be 4"
                                        r" \(local 4 x data-parallel 1 x accumulation 1\)"):
        train(args + derived, tmp_path)
    # Another tokenizer with the same vocabulary size would load silently and read token ids as other text.
    with pytest.raises(UserError, match=r"\[model\] tokenizer_path: .*step-2 was trained with another tokenizer than"
                                        r" this run's \(tiktoken:.*ranks=400\)"):
        train(args + ["--model.tokenizer_vocab_size", "400"], tmp_path)
    kept = train(args + ["--training.local_batch_size", "4"], tmp_path)  # PARITY sets global_batch_size = 8
    assert kept.losses == pytest.approx(straight.losses[2:], rel=1e-5)
    assert "global batch changes" not in caplog.text
    changed = train(args + ["--training.local_batch_size", "4", "--training.global_batch_size", "4",
                            "--checkpoint.load_step", "2"], tmp_path)
    assert len(changed.losses) == 2
    assert "the global batch changes from 8 to 4 sequences at step 3" in caplog.text


def test_a_file_where_a_checkpoint_goes_stops_the_run_with_one_line(tmp_path):
    """A stray plain file named step-4 in the checkpoint folder: the run stops at the step-4 save with one
    line naming it; the file and the step-2 checkpoint are kept (issue 34)."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "step-4").write_text("mine")
    with pytest.raises(UserError, match=r"\[checkpoint\] folder: .*checkpoint/step-4 is a file, where checkpoint"
                                        r" step-4 is to be saved; move it away"):
        train(["--training.local_batch_size", "8", "--training.steps", "4", "--checkpoint.enable",
               "--checkpoint.interval", "2"], tmp_path)
    assert complete_steps(tmp_path / "checkpoint") == [2]
    assert (tmp_path / "checkpoint" / "step-4").read_text() == "mine"


def test_excluding_model_and_optimizer_continues_from_fresh_weights(tmp_path, caplog):
    args = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(args + ["--training.stop_at_step", "2"], tmp_path)
    fresh = train(args[:4], tmp_path / "fresh")
    resumed = train(args + ["--checkpoint.exclude_from_loading", "model,optimizer"], tmp_path)
    assert "model weights not loaded ([checkpoint] exclude_from_loading)" in caplog.text
    # The same freshly initialised weights as a new run, continued at step 3 with that run's data position.
    # A loaded model would give the straight run's step-3 loss exactly. Fresh weights on the step-3 windows
    # give what a run that also restarts the step counter (same data position, same initial weights) sees first.
    assert len(resumed.losses) == 2 and resumed.losses[0] != fresh.losses[2]
    restarted = train(args + ["--checkpoint.exclude_from_loading", "model,optimizer,train_state",
                              "--checkpoint.load_step", "2", "--training.steps", "1"], tmp_path)
    assert restarted.losses[0] == resumed.losses[0]


FULL_DISK = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_save_that_cannot_be_written_is_one_line_and_leaves_the_earlier_ones(tmp_path, async_mode):
    """A disk that fills during a save (here: a file-size limit the process sets itself, so that writing a
    checkpoint file fails with 'File too large'): one error line naming the folder and the cause, exit 2,
    no partial folder left, the step-2 checkpoint untouched (issue 35)."""
    args = ["--training.local_batch_size", "8", "--training.steps", "6", "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.async_mode", async_mode, "--metrics.no-enable_tensorboard"]
    train(args + ["--training.stop_at_step", "2"], tmp_path)  # step-2 saved, the data prepared
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint" / "step-2").iterdir()}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, *PARITY, *args, "--job.dump_folder", str(tmp_path)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "[checkpoint] folder: could not save step-4 into" in errors[0] and "File too large" in errors[0]
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
    assert {p.name: p.read_bytes() for p in (folder / "step-2").iterdir()} == before


def test_an_emptied_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    args = ["--training.local_batch_size", "8", "--training.steps", "6", "--checkpoint.enable",
            "--checkpoint.interval", "2"]
    train(args + ["--training.stop_at_step", "4"], tmp_path)
    newest = tmp_path / "checkpoint" / "step-4"
    for f in newest.iterdir():
        f.unlink()
    resumed = train(args, tmp_path)
    assert len(resumed.losses) == 4  # steps 3-6, from step 2
    assert ("its .metadata is missing (the folder was emptied" in caplog.text
            and (newest.parent / "step-4.damaged").is_dir())


def test_a_split_that_selects_no_documents_names_the_key(tmp_path):
    with pytest.raises(UserError, match=r"\[training.dataloader\] split='train\[50%:50%\]': selects no documents of"
                                        r" .*short_documents"):  # local files (PARITY's) say it as the bundled ones do
        train(["--training.dataloader.split", "train[50%:50%]"], tmp_path)


def test_random_generator_state_is_restored(tmp_path, monkeypatch):
    import trainer.checkpoint as ckpt

    args = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(args + ["--training.stop_at_step", "2"], tmp_path)
    saved = torch.get_rng_state()  # nothing draws random numbers after the step-2 save
    torch.rand(1000)  # move the generator on, as a new process would start elsewhere
    restored = {}
    real = ckpt.Checkpointer.load

    def load(self):
        step = real(self)
        restored["state"] = torch.get_rng_state()
        return step

    monkeypatch.setattr(ckpt.Checkpointer, "load", load)
    train(args, tmp_path)
    assert torch.equal(restored["state"], saved)


# -- integrity: checksums written at save, verified at load, fallback to the previous checkpoint --

def _largest_data_file(folder):
    return max((p for p in folder.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def _flip_bit(path, offset=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


def test_find_damage_names_the_file_and_what_is_wrong(tmp_path):
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"m" * 100)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (folder / "__1_0.distcp").write_bytes(b"x" * 10)
    assert ckpt.find_damage(folder) is None  # no checksums.json: saved without verify, not checked
    ckpt.hash_share(folder)
    ckpt.merge_shares(folder)
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # no rank part left behind
    assert manifest["__0_0.distcp"] == {"bytes": 2048, "sha256": hashlib.sha256(bytes(range(256)) * 8).hexdigest()}
    assert ckpt.find_damage(folder) is None
    _flip_bit(folder / "__0_0.distcp", offset=2047)  # the last bit of the file: size unchanged
    assert ckpt.find_damage(folder) == "__0_0.distcp has other contents than written"
    (folder / ".metadata").write_bytes(b"\0" * 100)  # zero-filled, same size
    assert ckpt.find_damage(folder) == ".metadata has other contents than written (and 1 more file(s))"
    (folder / "__1_0.distcp").write_bytes(b"x" * 9)
    assert "__1_0.distcp" not in ckpt.find_damage(folder)  # the first damaged file, in name order, is named
    (folder / ".metadata").unlink()
    assert ckpt.find_damage(folder) == ".metadata is missing (and 2 more file(s))"
    (folder / "__0_0.distcp").unlink()
    (folder / ckpt.MANIFEST).write_text('{"files": {"a": {"bytes": "x"')
    assert ckpt.find_damage(folder).startswith("its checksums.json is unreadable (is not a checksum manifest (malf")
    (folder / ".metadata").write_bytes(b"m" * 100)
    (folder / ckpt.MANIFEST).write_text(json.dumps({"files": {".metadata": {"bytes": 100, "sha256": "0" * 64},
                                                              "__1_0.distcp": {"bytes": 10, "sha256": "0"}}}))
    assert ckpt.find_damage(folder) == ".metadata has other contents than written (and 1 more file(s))"


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_damaged_checkpoints_are_detected_and_the_previous_one_resumed_exactly(tmp_path, caplog, async_mode):
    args = ["--training.local_batch_size", "8", "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval",
            "2", "--checkpoint.keep_latest_k", "0", "--checkpoint.async_mode", async_mode]
    straight = train(args, tmp_path)
    folder = tmp_path / "checkpoint"
    assert complete_steps(folder) == [2, 4, 6]
    for step in (2, 4, 6):  # every file of every checkpoint is listed, and nothing else is left
        written = {p.name for p in (folder / f"step-{step}").iterdir()} - {ckpt.MANIFEST}
        assert set(json.loads((folder / f"step-{step}" / ckpt.MANIFEST).read_text())["files"]) == written
    _flip_bit(_largest_data_file(folder / "step-6"))  # one bit inside the tensors
    data = _largest_data_file(folder / "step-4")
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:-100])  # a truncated write
    caplog.set_level("WARNING")
    resumed = train(args, tmp_path)
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 2
    assert "step-6 is damaged: __0_0.distcp has other contents than written; moved to step-6.damaged" in warnings[0]
    assert f"step-4 is damaged: __0_0.distcp is not the {size} bytes written" in warnings[1]
    # Resumed from step 2, bit for bit the run that was never damaged; the damaged folders are kept.
    assert resumed.losses == straight.losses[2:] and resumed.grad_norms == straight.grad_norms[2:]
    assert {"step-4.damaged", "step-6.damaged"} <= {p.name for p in folder.iterdir()}
    assert complete_steps(folder) == [2, 4, 6]  # saved again by the resumed run


def test_damage_without_fallback_or_in_a_named_checkpoint_stops_with_one_line(tmp_path):
    args = ["--training.local_batch_size", "8", "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval",
            "2"]
    train(args, tmp_path)
    folder = tmp_path / "checkpoint"
    _flip_bit(folder / "step-4" / ".metadata")
    with pytest.raises(UserError, match=r"^\[checkpoint\] .*step-4 is damaged: .metadata has other contents than"
                                        r" written; with fallback_on_damage = true the previous"):
        train(args + ["--checkpoint.no-fallback_on_damage"], tmp_path)
    with pytest.raises(UserError, match=r"^\[checkpoint\] load_step: .*step-4 is damaged: .metadata has other"):
        train(args + ["--checkpoint.load_step", "4"], tmp_path)
    with pytest.raises(UserError, match=r"^\[checkpoint\] initial_load_path: .*step-4 is damaged"):
        train(args + ["--checkpoint.initial_load_path", str(folder / "step-4")], tmp_path / "other")
    assert complete_steps(folder) == [2, 4]  # nothing moved or lost by a refused run
    _flip_bit(folder / "step-2" / ".metadata")
    with pytest.raises(UserError,
                       match=r"every checkpoint in .* is damaged \(kept as step-4.damaged, step-2.damaged\)"):
        train(args, tmp_path)
    # Without verify, only damage that stops DCP is seen (a zero-filled metadata file, here).
    (folder / "step-2.damaged").rename(folder / "step-2")
    metadata = folder / "step-2" / ".metadata"
    metadata.write_bytes(bytes(metadata.stat().st_size))
    with pytest.raises(UserError, match=r"step-2 is not a readable checkpoint"):
        train(args + ["--checkpoint.no-verify"], tmp_path)


def test_streamed_data_resumes_exactly_and_on_another_batch_split(tmp_path, caplog):
    """A hub dataset read with streaming = true (here a local folder laid out like a hub repo):
    the lanes' positions resume bit for bit, and with accumulation instead of a wider batch."""
    from trainer.data.sources import bundled_documents

    repo = tmp_path / "hub_dataset"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "train-00000.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in bundled_documents()))
    args = ["--training.dataset_path", "", "--training.dataset", str(repo), "--training.dataloader.streaming",
            "--validation.dataset_path", str(repo / "data"), "--training.local_batch_size", "8",
            "--training.steps", "6", *CKPT]
    straight = train(args, tmp_path / "straight")
    train(args + ["--training.stop_at_step", "3"], tmp_path / "r")
    resumed = train(args, tmp_path / "r")
    assert resumed.losses == straight.losses[3:]
    train(args + ["--training.stop_at_step", "3"], tmp_path / "acc")
    accumulated = train(args + ["--training.local_batch_size", "4"], tmp_path / "acc")  # 2 microbatches of 4
    assert accumulated.losses == pytest.approx(straight.losses[3:], rel=1e-5)
    # Another global batch: 4 lanes instead of 8 restart at the earliest saved document (every saved
    # lane is read back, not only the ones this run has), with a warning.
    train(args + ["--training.stop_at_step", "3"], tmp_path / "other")
    narrower = train(args + ["--training.local_batch_size", "4", "--training.global_batch_size", "4"],
                     tmp_path / "other")
    assert len(narrower.losses) == 3 and "saved with 8 lanes (windows per global batch), this run has 4" in caplog.text


def test_a_resume_with_another_attention_says_so(tmp_path, caplog, monkeypatch):
    """The attention a run was trained with is saved with the step; continuing it with another
    [model] attn_mask_type says so in one warning (and continues as configured). A checkpoint saved before
    the key existed (no record) was trained causal: continuing it block-causal says so too."""
    args = ["--training.local_batch_size", "8", "--training.steps", "4", *CKPT]
    train(args + ["--training.stop_at_step", "2", "--model.attn_mask_type", "causal"], tmp_path)
    train(args + ["--training.stop_at_step", "3", "--model.attn_mask_type", "causal"], tmp_path)
    assert "attn_mask_type" not in caplog.text  # the same attention: nothing to say
    train(args, tmp_path)  # block_causal, the default
    assert ("step-3 was trained with causal attention; this run continues with block_causal attention, as configured"
            " (set attn_mask_type = 'causal' to continue as it was trained)") in caplog.text
    # An older version's checkpoint: no record of its attention.
    real = ckpt.Checkpointer.__init__

    def older(self, *a, **kw):
        real(self, *a, **kw)
        self.attention = ""

    with monkeypatch.context() as m:
        m.setattr(ckpt.Checkpointer, "__init__", older)
        train(args + ["--training.stop_at_step", "2", "--model.attn_mask_type", "causal"], tmp_path / "old")
    assert "train_state.attention" not in FileSystemReader(
        str(tmp_path / "old" / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    caplog.clear()
    train(args + ["--training.stop_at_step", "3"], tmp_path / "old")
    assert "step-2 was trained before [model] attn_mask_type existed, with causal attention" in caplog.text


def test_a_resume_on_other_data_says_what_changed_and_what_the_position_now_means(tmp_path, caplog):
    """The training data are recorded with the step; a run continued on other data (another file, or a mix with
    other weights) says, in one warning, what it was trained on, what it reads now and that the saved position
    continues in the new data. Continued on the same data: nothing said."""
    docs = Path(__file__).resolve().parents[1] / "fixtures" / "short_documents.txt"
    other = tmp_path / "other.txt"
    other.write_text(docs.read_text()[::-1])
    args = ["--training.local_batch_size", "8", "--training.steps", "4", "--training.dataset_path", str(docs), *CKPT]
    train(args + ["--training.stop_at_step", "2"], tmp_path)
    train(args + ["--training.stop_at_step", "3"], tmp_path)
    assert "[training] data" not in caplog.text
    train(args + ["--training.dataset_path", str(other)], tmp_path)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("[training] data:"))
    assert (f"step-3 was trained on {docs} [train]; this run reads {other} [train]: the saved data position (3"
            " steps read) continues in these data as if they were the same") in line, line
    assert "exclude_from_loading" in line


def test_the_dry_run_says_how_checkpoints_are_saved():
    from trainer.dry_run import describe_plan
    from trainer.plan import build_job_plan

    def line(world: int, *args: str) -> str:
        plan = build_job_plan(load_config(overrides=["--checkpoint.enable", *args]), world, check_memory=False)
        return next(t for t in describe_plan(plan).splitlines() if t.startswith("Checkpoints:"))

    assert line(1).endswith("in the foreground")
    assert line(1, "--checkpoint.async_mode", "async").endswith("in the background ('async')")
    assert line(4, "--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.interval", "50").endswith(
        "every 50 steps and at the last into <dump>/checkpoint (DCP, each rank writes its share), in the background"
        " ('async_with_pinned_mem'); their collectives run on a gloo process group of their own (4 ranks)")
    plan = build_job_plan(load_config(overrides=[]), 1, check_memory=False)
    assert "Checkpoints:" not in describe_plan(plan)
