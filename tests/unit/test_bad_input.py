"""Bad input of every kind: one line naming the key or file, never a traceback (issue: reliability).

Each case goes through what a run does before anything is allocated: the config, then the job
plan (``load_plan``); a few go through the real entry points.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_MODEL, load_plan
from trainer.config import JobConfig
from trainer.config.render import walk_sections
from trainer.errors import ConfigError, UserError, one_line
from trainer.optim import lr_factor

REPO = Path(__file__).resolve().parents[2]
OVR = "--model.overrides."
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel"]
GPT = ["--model.attn_mask_type", "causal", "--model.modules", "tiny_gpt", "--model.name", "tiny_gpt",
       "--model.flavor", "tiny", "--training.seq_len", "32"]

BAD = [
    # model args the family cannot build (each names the [model.overrides] key)
    ([OVR + "dim", "-64"], "[model.overrides] dim=-64: must be >= 1"),
    ([OVR + "n_heads", "0"], "[model.overrides] n_heads=0: must be >= 1"),
    ([OVR + "n_heads", "7"], "[model.overrides] n_heads=7: must divide dim=256"),
    ([OVR + "n_kv_heads", "3"], "[model.overrides] n_kv_heads=3: must divide n_heads=16"),
    ([OVR + "n_kv_heads", "32"], "[model.overrides] n_kv_heads=32: must divide n_heads=16"),
    ([OVR + "multiple_of", "0"], "[model.overrides] multiple_of=0: must be >= 1"),
    ([OVR + "ffn_dim_multiplier", "abc"], "[model.overrides] ffn_dim_multiplier: got 'abc', expected float"),
    ([OVR + "ffn_dim_multiplier", "-2.0"], "[model.overrides] ffn_dim_multiplier=-2.0: must be > 0"),
    ([OVR + "n_layers", "0"], "[model.overrides] n_layers=0: must be >= 1"),
    ([OVR + "n_layers", "-1"], "[model.overrides] n_layers=-1: must be >= 1"),
    ([OVR + "vocab_size", "0"], "[model.overrides] vocab_size=0: must be >= 1"),
    ([OVR + "norm_eps", "-1.0"], "[model.overrides] norm_eps=-1.0: must be > 0"),
    ([OVR + "n_heads", "256"], "n_heads=256: the head size 1 must be even"),
    # sizes that would exhaust memory: refused by arithmetic before anything is allocated
    ([OVR + "dim", "100000000"], "GiB per device for weights, gradients and Adam state"),
    (["--training.local_batch_size", "1000000000"], "[training] local_batch_size=1000000000, seq_len=256: the logits"),
    (["--training.seq_len", "1000000000"], "seq_len=1000000000: the logits of one microbatch"),
    (["--training.seq_len", str(2**63 - 1)], "the logits of one microbatch"),
    # numbers out of range
    (["--optimizer.beta2", "1.0"], "[optimizer] beta2: got 1.0, expected a number >= 0 and < 1"),
    (["--debug.seed", str(2**64)], "[debug] seed"),
    (["--comm.train_timeout_seconds", "1000000000000000"], "[comm] train_timeout_seconds"),
    (["--comm.init_timeout_seconds", "1000000000000000"], "[comm] init_timeout_seconds"),
    # counters and batches with a ceiling: a typo is one line, not an overflow deep in numpy (issue 34)
    (["--training.global_batch_size", "4611686018427387904"], "[training] global_batch_size: got 4611686018427387904"),
    (["--training.steps", str(10**20)],
     "[training] steps: got 100000000000000000000, expected an integer > 0 and <= 1,000,000,000"),
    (["--training.steps", str(10**26)], "[training] steps: got 100000000000000000000000000"),
    (["--checkpoint.interval", str(10**12)], "[checkpoint] interval"),
    (["--checkpoint.keep_latest_k", str(2**63)], "[checkpoint] keep_latest_k"),
    (["--training.stop_at_step", str(10**20)], "[training] stop_at_step"),
    (["--training.gc_freq", str(2**63)], "[training] gc_freq"),
    # a value is checked whatever the mode that reads it
    (["--activation_checkpoint.selective_ac_option", "abc"],
     "selective_ac_option: got 'abc', expected 'op' or a positive integer"),
    (["--activation_checkpoint.selective_ac_option", "-3"], "selective_ac_option: got '-3'"),
    # exclusions that would load nothing, or an optimizer state without its weights
    (["--checkpoint.exclude_from_loading", "model,optimizer,dataloader,train_state,rng"], "every part is excluded"),
    (["--checkpoint.exclude_from_loading", "model"], "'model' without 'optimizer' would load the optimizer state"),
    # ranges of the mixture-of-experts family, and the key each error names (issue 35)
    (MOE + [OVR + "n_dense_layers", "4"], "[model.overrides] n_dense_layers=4: must be < n_layers=4"),
    (MOE + [OVR + "route_scale", "1e30"], "[model.overrides] route_scale=1e+30: must be <= 100"),
    (MOE + [OVR + "aux_loss_coef", "1e30"], "[model.overrides] aux_loss_coef=1e+30: must be <= 100"),
    (MOE + [OVR + "head_dim_override", "3"], "[model.overrides] head_dim_override=3: the head size 3 must be even"),
    (MOE + [OVR + "vocab_size", "10"],
     "[model.overrides] vocab_size=10: a tiktoken tokenizer needs the 256 byte tokens"),
    (["--profiling.activation_memory_steps", "0"], "[profiling] activation_memory_steps: 0 is not a step"),
    (["--profiling.activation_memory_steps", str(2**63)], "[profiling] activation_memory_steps"),
    # error lines that name the right thing (issue 35)
    (["--training.dataset_mix"],
     "--training.dataset_mix: set one entry at a time, e.g. --training.dataset_mix.python_docs 1"),
    (["--model.tokenizer_path", "/tmp"], "[model] tokenizer_path: a folder, not a file: /tmp"),
    (["--training.dataset_path", "README.md "], "[training] dataset_path: file not found: 'README.md '"),
    # user modules that cannot be imported
    (["--model.modules", "broken_syntax"], "[model] modules: cannot import 'broken_syntax': SyntaxError"),
    (["--model.modules", "broken_import"], "cannot import 'broken_import': RuntimeError: this module refuses to load"),
    (["--model.modules", "../etc"], "[model] modules: '../etc' is not a Python module name"),
    # pipeline keys are checked even where a pipeline degree of 1 ignores them
    (["--parallelism.pipeline_parallel_split_points", "layers.2,,layers.4"],
     "[parallelism] pipeline_parallel_split_points: got 'layers.2,,layers.4': an empty entry"),
    (["--parallelism.pipeline_parallel_schedule", "ZeroBubbleV"], "did you mean 'ZBVZeroBubble'?"),
    # bytes from the shell that are not UTF-8 text (the resolved config could not be written)
    (["--job.description", "caf\udce9"], "'--job.description': the value is not valid UTF-8 text"),
    # a feature the family does not have, refused before the run rather than after it
    (GPT + ["--checkpoint.export_hf"], "[checkpoint] export_hf: model family tiny_gpt has no Hugging Face adapter"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_line_naming_the_key(argv, words):
    with pytest.raises(ConfigError) as info:
        load_plan(argv, 1)
    message = str(info.value)
    assert words in message and "\n" not in message


def test_a_malformed_schedule_csv_is_refused_at_any_pipeline_degree(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("0F0,zz\n")
    with pytest.raises(ConfigError, match="row 1: 'zz' is not an action like 0F1"):
        load_plan(["--parallelism.pipeline_parallel_schedule_csv", str(csv)], 1)
    csv.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_plan(["--parallelism.pipeline_parallel_schedule_csv", str(csv)], 1)


def test_a_schedule_csv_torch_cannot_run_is_refused_when_the_job_is_planned(tmp_path):
    """Each row well formed, but rank 1's actions written first: the plan's stage placement is used."""
    csv = tmp_path / "s.csv"
    csv.write_text("1F0,3F0,3B0,1B0\n0F0,2F0,2B0,0B0\n")
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "8",
           "--parallelism.pipeline_parallel_schedule_csv", str(csv)]
    with pytest.raises(ConfigError, match=r"row 1 \(pipeline rank 0\) has 1F0, but stage 1 runs on rank 1"):
        load_plan(pp2, 2)
    csv.write_text("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n")
    load_plan(pp2, 2)
    # One stage per rank: the CSV's own stages decide the count (the default of a multi-stage schedule,
    # two per rank, does not apply); with split points for four stages, the message names the keys.
    csv.write_text("\ufeff0F0,0B0\n1F0,1B0\n", encoding="utf-8")  # with a byte-order mark
    assert load_plan(pp2, 2).pipeline.num_stages == 2
    with pytest.raises(ConfigError, match=r"uses stages \[0, 1\], but the job has stages 0..3 \(as many as the CSV"
                                        r" uses, unless \[parallelism\] pipeline_parallel_split_points"):
        load_plan(pp2 + ["--parallelism.pipeline_parallel_split_points", "layers.1,layers.2,layers.3"], 2)


def test_a_one_step_smoke_test_of_any_job_works(caplog):
    # configs/debug_model.toml warms up over 2 steps; with 1 step the warm-up is shortened, with a warning.
    plan = load_plan(["--training.steps", "1"], 1, config_file="configs/debug_model.toml")
    assert "warmup_steps=2 exceeds [training] steps=1" in caplog.text
    assert lr_factor(1, plan.config.lr_scheduler, 1) == 1.0
    # torchtitan-style decay_ratio 0.8 of 3 steps after 2 warm-up steps: the decay gets the 1 step left.
    caplog.clear()
    plan = load_plan(["--training.steps", "3", "--lr_scheduler.decay_ratio", "0.8"], 1,
                     config_file="configs/debug_model.toml")
    assert "decay_ratio=0.8 of [training] steps=3 is 2 decay steps, but warm-up leaves 1" in caplog.text
    assert [lr_factor(s, plan.config.lr_scheduler, 3) for s in (1, 2, 3)] == pytest.approx([0.5, 1.0, 0.0])


IGNORED = [  # settings that do nothing in the job as configured: one warning line each (issue 35); (argv, world, words)
    (["--checkpoint.load_step", "3"], 1, "[checkpoint] load_step=3 is ignored: [checkpoint] enable = false"),
    (["--validation.dataset_path", "README.md"], 1,
     "[validation] dataset_path is ignored: [validation] enable = false"),
    (["--validation.enable"], 1, "[validation] reads the training data itself (python_docs, split 'train')"),
    (["--training.steps", "3", "--parallelism.pipeline_parallel_degree", "2", "--profiling.pipeline_timeline_steps",
      "2,5,9"], 2, "[profiling] pipeline_timeline_steps: steps 5, 9 after the last step ([training] steps = 3)"),
    (["--parallelism.pipeline_parallel_frontend", "tracer"], 1, "pipeline_parallel_frontend = 'tracer' not used"),
    (["--training.dataset_mix.python_docs", "1", "--training.dataset_path", "README.md",
      "--training.dataloader.no-streaming"], 1, "[training] dataset_path is ignored: [training.dataset_mix]"),
]


@pytest.mark.parametrize("argv, world, words", IGNORED, ids=[" ".join(a)[:50] for a, _, _ in IGNORED])
def test_a_setting_the_job_ignores_is_said_in_one_warning(caplog, argv, world, words):
    load_plan(argv, world)
    assert words in caplog.text


def run_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "fixtures"), "PYTHON": sys.executable}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("ngpu", ["0", "abc", "-1"])
def test_run_train_refuses_a_bad_process_count(ngpu):
    proc = subprocess.run(["./run_train.sh"], cwd=REPO, env={**os.environ, "NGPU": ngpu}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: NGPU={ngpu}: expected a positive number of processes (e.g. NGPU=4)"


def test_help_piped_into_head_ends_quietly():
    proc = subprocess.run(f"{sys.executable} train.py --help | head -3", shell=True, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    assert len(proc.stdout.splitlines()) == 3


def test_entry_point_prints_one_line_for_a_model_error():
    proc = run_cli([sys.executable, "train.py", *TINY_MODEL, OVR + "n_kv_heads", "3", "--print-config"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (proc.stderr.strip()
            == "error: [model.overrides] n_kv_heads=3: must divide n_heads=4 (grouped-query attention)")


def test_folders_that_cannot_hold_the_run_are_named(tmp_path):
    from trainer.config import load_config
    from trainer.train import prepare_folders

    with pytest.raises(ConfigError, match=r"\[job\] dump_folder: must not be empty"):
        load_config(overrides=["--job.dump_folder", ""])
    afile = tmp_path / "a_file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"\[job\] dump_folder: .*a_file exists and is not a folder"):
        load_config(overrides=["--job.dump_folder", str(afile)])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("x")
    with pytest.raises(ConfigError, match=r"\[checkpoint\] folder: .*checkpoint exists and is not a folder"):
        load_config(overrides=["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable"])
    # a folder that cannot be created (under a file): refused at start, before any collective
    config = load_config(overrides=["--job.dump_folder", str(afile / "sub")])
    with pytest.raises(UserError, match=r"\[job\] dump_folder: cannot write to .*a_file/sub"):
        prepare_folders(config)
    # every output folder is checked the same way: the data cache, traces, TensorBoard (issue 34)
    (tmp_path / "run" / "cache").write_text("x")
    with pytest.raises(ConfigError, match=r"\[training.dataloader\] cache_folder: .*cache exists and is not a folder"):
        load_config(overrides=["--job.dump_folder", str(tmp_path / "run"),
                               "--training.dataloader.cache_folder", "cache"])
    for key in ("--training.dataloader.cache_folder", "--profiling.save_traces_folder", "--metrics.save_tb_folder"):
        config = load_config(overrides=["--job.dump_folder", str(tmp_path / "run2"), key, str(afile / "sub"),
                                        "--parallelism.pipeline_parallel_degree", "2",
                                        "--profiling.pipeline_timeline_steps", "1"])
        section, name = key[2:].rsplit(".", 1)
        with pytest.raises(UserError, match=rf"\[{section}\] {name}: cannot write to .*a_file/sub"):
            prepare_folders(config)


def test_config_file_that_is_not_a_file():
    from trainer.config import load_config

    with pytest.raises(ConfigError, match=r"\[job\] config_file: not a regular file: /dev/null"):
        load_config("/dev/null")


def test_local_files_honour_the_split_key(tmp_path):
    from trainer.config import load_config
    from trainer.data import load_documents
    from trainer.data.sources import training_source

    def docs(training):
        return load_documents(training_source(training), training.dataloader)

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(10)))
    whole = docs(load_config(overrides=["--training.dataset_path", str(data)]).training)
    head = docs(load_config(overrides=["--training.dataset_path", str(data),
                                                 "--training.dataloader.split", "train[:30%]"]).training)
    assert len(whole) == 10 and [d["text"] for d in head] == ["document 0", "document 1", "document 2"]
    with pytest.raises(UserError, match=r"\[training.dataloader\] split='validation': local files are one split"):
        docs(load_config(overrides=["--training.dataset_path", str(data),
                                              "--training.dataloader.split", "validation"]).training)


# -- fuzzing what a user can type into the free tables, the paths and the numbers -------------------
# Each generated input must plan, or be refused with a UserError (printed as one line, exit 2):
# never another exception, never a hang (hypothesis' deadline is per example).

PATH_KEYS = ["job.dump_folder", "model.tokenizer_path", "training.dataset_path", "training.dataloader.cache_folder",
             "validation.dataset_path", "checkpoint.folder", "checkpoint.initial_load_path", "metrics.save_tb_folder",
             "parallelism.pipeline_parallel_schedule_csv", "job.config_file"]
PATHS = st.one_of(
    st.sampled_from(["", "/", ".", "..", "/dev/null", "/proc/self/mem", "a\0b", "x" * 300, "/tmp/" + "y/" * 200,
                     "/nonexistent/q", "~", "//", "/etc/passwd", "configs", "README.md", " ", "\n", "/tmp/\udcff"]),
    st.text(max_size=30),
)
HUGE = st.one_of(
    st.sampled_from(["9223372036854775808", "-9223372036854775809", str(2**64), "1e308", "1e309", "-1e309", "inf",
                     "-inf", "nan", "1e-320", str(10**30), "-1", "0", "-0.0"]),
    st.integers().map(str), st.floats().map(repr),
)
NUMERIC_KEYS = [".".join(path + (name,)) for path, fields in walk_sections(JobConfig) for name, spec in fields.items()
                if spec.kind in ("int", "float")]
LLAMA_FIELDS = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
                "norm_eps", "rope_theta", "max_seq_len", "tie_embeddings"]


def _plans_or_refuses(argv):
    try:
        load_plan(argv)
    except UserError as e:
        assert str(e).strip() and "\n" not in str(e), repr(str(e))  # one line, whatever the input


@settings(max_examples=120, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(PATH_KEYS), value=PATHS)
def test_fuzz_paths(key, value):
    _plans_or_refuses([f"--{key}={value}"])


@settings(max_examples=150, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(NUMERIC_KEYS), value=HUGE)
def test_fuzz_huge_numbers(key, value):
    _plans_or_refuses([f"--{key}={value}"])


@settings(max_examples=150, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.sampled_from(LLAMA_FIELDS), st.from_regex(r"\A[a-z_]{1,12}\Z")),
    value=st.one_of(HUGE, st.sampled_from(["true", "abc", "[1]", "{a = 1}", '"8"', ""])),
)
def test_fuzz_model_overrides(key, value):
    _plans_or_refuses([f"--model.overrides.{key}", value] if value else [f"--model.overrides.{key}="])


@settings(max_examples=80, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(
        st.sampled_from(["attention.wq", "attention", "feed_forward.w1", "tok_embeddings", "output", "layers"]),
        st.from_regex(r"\A[a-z_]{1,8}(\.[a-z0-9_]{1,5}){0,2}\Z"),
    ),
    value=st.one_of(st.sampled_from(["colwise", "rowwise", "replicate", "bogus", "1", "true", "[1]"]),
                    st.text(max_size=8)),
)
def test_fuzz_tensor_parallel_overrides(key, value):
    _plans_or_refuses(["--parallelism.tensor_parallel_plan", "auto", "--parallelism.tensor_parallel_degree", "2",
                       f"--parallelism.tensor_parallel_overrides.{key}={value}"])


def test_control_characters_in_an_error_stay_on_one_line():
    out = run_cli([sys.executable, "train.py", "--parallelism.pipeline_parallel_schedule_csv", "a\nb.csv", "--dry-run"])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "a\\nb.csv" in lines[0]
    assert one_line("x\r\ny\0") == "x\\r\\ny\\x00"


@pytest.mark.parametrize("launcher_args, ok", [
    (["--standalone", "--nproc-per-node=3"], False),  # torchrun leaves --nnodes at "1:1": the world is 3
    (["--standalone", "--nproc-per-node=2"], True),
    (["--nnodes=1:2", "--nproc-per-node=1"], True),  # an elastic range is planned at its largest size
])
def test_launcher_checks_the_config_for_its_own_world_size(capsys, launcher_args, ok):
    from torch.distributed.run import get_args_parser

    from trainer.launch import check_config

    args = get_args_parser().parse_args([*launcher_args, "train.py", *TINY_MODEL,
                                         "--parallelism.tensor_parallel_degree", "2"])
    code = check_config(args)
    err = capsys.readouterr().err
    if ok:
        assert code == 0, err
    else:
        assert code == 2 and "does not divide NGPU 3" in err and err.count("\n") == 1, err  # the launch variable


def test_a_split_set_beside_prepared_shards_is_said_to_be_ignored(tmp_path, caplog):
    """Prepared token shards are read whole: a split configured for them does nothing, which the config check
    says in one warning per key and the dry run's data lines show (they named the split as if it applied)."""
    from trainer.data import Tokenizer, prepare_shards
    from trainer.dry_run import describe_plan

    prepare_shards(["one document", "another document"], Tokenizer(max_ranks=510), tmp_path / "shards", source="t")
    shards = str(tmp_path / "shards")
    plan = load_plan(["--training.dataset_path", shards, "--training.dataloader.split", "train[:90%]",
                      "--validation.enable", "--validation.dataset_path", shards, "--validation.split", "train[90%:]"])
    for key, split in (("[training.dataloader] split", "train[:90%]"), ("[validation] split", "train[90%:]")):
        assert f"{key} = {split!r} does not apply to {shards}: prepared token shards are read whole" in caplog.text
    text = describe_plan(plan)
    assert f"Data: {shards} (prepared token shards, read whole)" in text
    assert f"Validation: {shards} (prepared token shards, read whole)" in text
    caplog.clear()
    load_plan(["--training.dataset_path", shards])  # the default split: nothing to say
    assert "does not apply" not in caplog.text


def test_a_microbatch_count_no_schedule_is_planned_for_is_one_line():
    """10^6 microbatches per step: the schedule's action lists and their replay took over a minute to plan."""
    with pytest.raises(ConfigError, match=r"local_batch_size=1000000 / \[parallelism\] pipeline_parallel_microbatch"
                                          r"_size=1: 1,000,000 microbatches per step, more than 10,000"):
        load_plan(["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "1000000",
                   "--training.global_batch_size", "-1"], 2)
