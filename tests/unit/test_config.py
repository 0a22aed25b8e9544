"""Config loading: precedence, CLI forms, extends, resolved-config round trip, and every error."""

import dataclasses
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import load_plan
from trainer.config import JobConfig, help_text, load_config, parse_args, to_toml
from trainer.config.reference import reference_markdown
from trainer.config.render import walk_sections
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_the_schema_defaults():
    assert load_config() == JobConfig()


def test_precedence_defaults_then_toml_then_cli(tmp_path):
    cfg = write(tmp_path, "job.toml", "[training]\nsteps = 7\nseq_len = 64\n")
    config = load_config(cfg, ["--training.steps", "9"])
    assert config.training.steps == 9  # CLI beats TOML
    assert config.training.seq_len == 64  # TOML beats default
    assert config.training.local_batch_size == JobConfig().training.local_batch_size


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.steps", "5"], 5),
        (["--training.steps=5"], 5),
        (["--training.steps", "5", "--training.steps", "6"], 6),  # last wins
    ],
)
def test_cli_value_forms(argv, expected):
    assert load_config(overrides=argv).training.steps == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--debug.deterministic"], True),
        (["--debug.deterministic", "true"], True),
        (["--debug.deterministic=true"], True),
        (["--debug.deterministic=false"], False),
        (["--debug.deterministic", "--debug.no-deterministic"], False),
        (["--debug.no_deterministic"], False),
        (["--debug.deterministic=yes"], True),
    ],
)
def test_cli_boolean_forms(argv, expected):
    assert load_config(overrides=argv).debug.deterministic is expected


def test_bare_boolean_does_not_swallow_next_flag():
    config = load_config(overrides=["--debug.deterministic", "--training.steps", "3"])
    assert config.debug.deterministic and config.training.steps == 3


def test_hyphens_and_underscores_are_interchangeable():
    a = load_config(overrides=["--training.local-batch-size", "4"])
    b = load_config(overrides=["--training.local_batch_size", "4"])
    assert a == b and a.training.local_batch_size == 4


@pytest.mark.parametrize(
    "value, expected",
    [
        ("layers.1,layers.3", ["layers.1", "layers.3"]),
        ('["layers.1", "layers.3"]', ["layers.1", "layers.3"]),
        ("", []),
        ("layers.2", ["layers.2"]),
    ],
)
def test_cli_list_forms(value, expected):
    config = load_config(overrides=["--parallelism.pipeline_parallel_split_points", value])
    assert config.parallelism.pipeline_parallel_split_points == expected


def test_nested_table_and_free_table():
    config = load_config(
        overrides=["--training.dataloader.text_column", "content", "--model.overrides.n_layers", "3"]
    )
    assert config.training.dataloader.text_column == "content"
    assert config.model.overrides == {"n_layers": 3}


def test_nested_table_in_toml(tmp_path):
    cfg = write(tmp_path, "a.toml", '[training.dataloader]\nsplit = "validation"\n[model.overrides]\ndim = 64\n')
    config = load_config(cfg)
    assert config.training.dataloader.split == "validation"
    assert config.model.overrides == {"dim": 64}


def test_choices_are_case_insensitive_and_canonicalised():
    assert load_config(overrides=["--optimizer.name", "adamw"]).optimizer.name == "AdamW"


def test_int_accepted_for_float_and_optional_unset():
    config = load_config(overrides=["--optimizer.lr", "1", "--lr_scheduler.decay_ratio", "none"])
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.lr_scheduler.decay_ratio is None


def test_extends_chain_relative_to_file(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base", "root.toml", '[training]\nsteps = 3\nseq_len = 32\n[model.overrides]\ndim = 64\n')
    write(tmp_path / "base", "mid.toml", 'extends = "root.toml"\n[training]\nseq_len = 48\n')
    leaf = write(tmp_path, "leaf.toml", 'extends = "base/mid.toml"\n[model.overrides]\nn_layers = 2\n')
    config = load_config(leaf)
    assert config.training.steps == 3 and config.training.seq_len == 48
    assert config.model.overrides == {"dim": 64, "n_layers": 2}  # tables merge entry by entry


def test_resolved_config_round_trips(tmp_path):
    config = load_config(
        overrides=[
            "--training.steps", "4", "--model.overrides.n_layers", "2", "--lr_scheduler.decay_ratio", "0.5",
            "--parallelism.pipeline_parallel_split_points", "layers.1", "--job.description", 'quote " and \\ slash',
        ]
    )
    path = write(tmp_path, "resolved.toml", to_toml(config))
    tomllib.loads(path.read_text())  # valid TOML
    reloaded = load_config(path)
    assert reloaded.job.config_file == str(path)  # the only difference: which file it came from
    assert dataclasses.replace(reloaded, job=config.job) == config


# -- round trip over generated configs --------------------------------------------------------

# Any character but lone surrogates (not Unicode text), with the ones TOML must escape made common.
TRICKY = st.sampled_from(['"', "\\", "'", "\x00", "\x1f", "\x7f", "\n", "\r", "\t", "\b", ".", " ", "=", "#", "\u2028"])
ANY_TEXT = st.text(alphabet=st.one_of(TRICKY, st.characters(exclude_categories=["Cs"])), max_size=12)
SCALAR = st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.booleans(), ANY_TEXT)


def _values(spec):
    """Values of the field's TOML type (not necessarily ones validation accepts)."""
    by_kind = {
        "bool": st.booleans(),
        "int": st.integers(-(2**63), 2**63 - 1),
        "float": st.floats(allow_nan=False),
        "str": st.sampled_from(spec.choices) if spec.choices else ANY_TEXT,
        "list": st.lists(st.integers(-(2**31), 2**31) if spec.elem == "int" else ANY_TEXT, max_size=3),
        "dict": st.dictionaries(ANY_TEXT, SCALAR, max_size=3),
    }
    values = by_kind[spec.kind]
    return st.one_of(st.none(), values) if spec.optional else values


FIELDS = {path + (name,): spec for path, fields in walk_sections(JobConfig) for name, spec in fields.items()}


def _build(cls, flat, prefix=()):
    kwargs = {}
    for field in dataclasses.fields(cls):
        path = prefix + (field.name,)
        if dataclasses.is_dataclass(field.type):
            kwargs[field.name] = _build(field.type, flat, path)
        elif path in flat:
            kwargs[field.name] = flat[path]
    return cls(**kwargs)


def _without_none(tree):
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None}


@settings(max_examples=150, deadline=None)
@given(flat=st.fixed_dictionaries({path: _values(spec) for path, spec in FIELDS.items()}))
def test_resolved_toml_holds_every_generated_value(flat):
    """The writer's half of the round trip, over every key: any value of the key's type comes back
    from the TOML unchanged (strings with control characters, quoted table keys, huge numbers)."""
    config = _build(JobConfig, flat)
    expected = _without_none(dataclasses.asdict(config))
    del expected["job"]["config_file"]
    assert tomllib.loads(to_toml(config)) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    description=ANY_TEXT.filter(lambda text: "\0" not in text),  # NUL: refused in every setting
    tp_overrides=st.dictionaries(
        st.from_regex(r"\A[a-z_]{1,6}(\.[a-z0-9_]{1,6}){0,3}\Z"), st.sampled_from(["colwise", "rowwise", "replicate"]),
        max_size=3,
    ),
)
def test_loaded_configs_round_trip(tmp_path, description, tp_overrides):
    """The whole round trip, through the loader and its validation, with the free-form values a
    user writes: text with any character but NUL, and dotted module names as table keys (TOML only: the
    command line splits keys at dots)."""
    table = "{" + ", ".join(f'"{k}" = "{v}"' for k, v in tp_overrides.items()) + "}"
    source = write(tmp_path, "job.toml",
                   f'[parallelism]\ntensor_parallel_plan = "auto"\ntensor_parallel_overrides = {table}\n')
    config = load_config(source, [f"--job.description={description}"])
    assert config.job.description == description and config.parallelism.tensor_parallel_overrides == tp_overrides
    reloaded = load_config(write(tmp_path, "resolved.toml", to_toml(config)))
    assert dataclasses.replace(reloaded, job=config.job) == config


def test_every_key_is_in_help_and_reference():
    text, ref = help_text(), reference_markdown()
    for path, fields in walk_sections(JobConfig):
        for name, spec in fields.items():
            assert "--" + ".".join(path + (name,)) in text
            assert f"`{name}`" in ref
            assert spec.doc, f"{path}.{name} has no doc"


def test_generated_reference_is_in_sync():
    assert (REPO / "docs" / "config_reference.md").read_text() == reference_markdown(), (
        "docs/config_reference.md is stale: run python -m trainer.config.reference > docs/config_reference.md"
    )


def test_help_ignores_broken_arguments():
    assert parse_args(["--nonsense", "--help"]).action == "help"


def test_shipped_configs_load():
    configs = sorted((REPO / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        load_config(path)


# (argv or TOML text, words the one-line message must contain)
CLI_ERRORS = [
    (["--training.stpes", "5"], ["[training] stpes", "unknown key", "did you mean 'steps'"]),
    # a removed key (the pace model's files) is unknown like a misspelling
    (["--parallelism.pipeline_parallel_pace_files", "p.json"], ["[parallelism] pipeline_parallel_pace_files",
                                                                 "unknown key"]),
    (["--traning.steps", "5"], ["[traning]", "unknown section", "did you mean 'training'"]),
    (["--steps", "5"], ["[steps]", "[training] steps"]),
    (["--training.steps", "ten"], ["[training] steps", "'ten'", "integer"]),
    (["--training.steps", "0"], ["[training] steps", "> 0"]),
    (["--training.steps", "1.5"], ["[training] steps", "integer"]),
    (["--training.steps"], ["--training.steps", "missing value"]),
    (["--training.steps", "--debug.seed", "1"], ["--training.steps", "missing value"]),
    (["--optimizer.name", "sgd"], ["[optimizer] name", "'sgd'", "'AdamW'"]),
    (["--optimizer.lr", "-1"], ["[optimizer] lr", ">= 0"]),
    (["--optimizer.lr", "nan"], ["[optimizer] lr", "finite"]),
    (["--optimizer.beta1", "1.5"], ["[optimizer] beta1", "< 1"]),
    (["--debug.deterministic=maybe"], ["[debug] deterministic", "true or false"]),
    (["--debug.no-deterministic=true"], ["takes no value"]),
    (["--parallelism.data_parallel_shard_degree", "0"], ["data_parallel_shard_degree", "or -1"]),
    (["--parallelism.tensor_parallel_degree", "0"], ["tensor_parallel_degree", ">= 1"]),
    (["--training.dataloader"], ["names a section"]),
    (["--training.steps.x", "1"], ["is a key, not a section"]),
    (["--model.overrides", "3"], ["set one entry at a time"]),
    (["--model.overrides.n_layer", "3"], ["[model.overrides] n_layer", "did you mean 'n_layers'"]),
    (["--model.overrides.n_layers", "two"], ["[model.overrides] n_layers", "'two'"]),
    (["--model.flavor", "9B"], ["[model] flavor", "'9B'"]),
    (["--model.name", "llama2"], ["[model] name", "llama3"]),
    (["--model.modules", "no_such_module_xyz"], ["[model] modules", "no_such_module_xyz"]),
    (["steps=5"], ["unexpected argument"]),
    (["--"], ["unexpected argument"]),
    (["--.x", "1"], ["malformed option"]),
    (["--job.config_file", "/nonexistent/job.toml"], ["config_file", "not found"]),
    (["--training.dataset_path", "/nonexistent/data.txt"], ["[training] dataset_path", "not found"]),
    (["--model.tokenizer_path", "/nonexistent/tok.model"], ["[model] tokenizer_path", "not found"]),
    (["--checkpoint.initial_load_path", "/nonexistent/step-3"], ["[checkpoint] initial_load_path", "not found"]),
    (["--world-size", "8"], ["--world-size: only used with --dry-run"]),
    (["--compare-schedules"], ["--compare-schedules: only used with --dry-run"]),
    (["--dry-run", "--compare-schedules=1"], ["--compare-schedules: takes no value"]),
    (["--dry-run", "--compare-schedules"], ["--compare-schedules: [parallelism] pipeline_parallel_degree is 1"]),
    (["--parallelism.pipeline_parallel_device_memory_gbytes_per_second", "3350"],
     ["[parallelism] pipeline_parallel_device_memory_gbytes_per_second", "pipeline_parallel_device_tflops"]),
    (["--training.global_batch_size", "12", "--parallelism.data_parallel_shard_degree", "1"],
     ["global_batch_size=12", "local_batch_size 8"]),
    (["--parallelism.tensor_parallel_degree", "3", "--training.seq_len", "96"],
     ["tensor_parallel_degree=3", "n_heads=16"]),
    (["--parallelism.tensor_parallel_degree", "16"], ["tensor_parallel_degree=16", "n_kv_heads=8"]),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "31", "--model.overrides.n_heads", "2",
      "--model.overrides.n_kv_heads", "2"], ["seq_len=31", "tensor_parallel_degree=2"]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
     ["selective_ac_option", "'x'"]),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"],
     ["seq_len=30", "2 * [parallelism] context_parallel_degree=2", "4 equal chunks"]),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4", "--training.seq_len",
      "36"], ["seq_len=36 / context_parallel_degree 2 = 18 tokens per rank", "tensor_parallel_degree=4"]),
    (["--parallelism.context_parallel_degree", "2", "--model.attn_mask_type", "causal", "--model.modules", "tiny_gpt",
      "--model.name", "tiny_gpt", "--model.flavor", "tiny", "--training.seq_len", "32"],
     ["context_parallel_degree=2", "tiny_gpt", "cp_buffers"]),
]


@pytest.mark.parametrize("argv, words", CLI_ERRORS, ids=[" ".join(a) for a, _ in CLI_ERRORS])
def test_cli_errors_name_the_key(argv, words):
    with pytest.raises(ConfigError) as info:
        load_plan(argv)  # what train.py and run_train.sh's pre-check do: the config, then the job plan
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


TOML_ERRORS = [
    ("[training]\nsteps = \n", ["malformed TOML", "line 2"]),
    ("[training\nsteps = 3\n", ["malformed TOML"]),
    ("[trainig]\nsteps = 3\n", ["[trainig]", "did you mean 'training'"]),
    ("[training]\nstep = 3\n", ["[training] step", "did you mean 'steps'"]),
    ('[training]\nsteps = "ten"\n', ["[training] steps", "'ten'", "string", "integer"]),
    ("[training]\nsteps = 3.0\n", ["[training] steps", "float", "integer"]),
    ("[training]\nsteps = true\n", ["[training] steps", "boolean"]),
    ("[debug]\ndeterministic = 1\n", ["[debug] deterministic", "true or false"]),
    ('[optimizer]\nlr = "1e-3"\n', ["[optimizer] lr", "a number"]),
    ('[optimizer]\nimplementation = "fast"\n', ["[optimizer] implementation", "'fused'"]),
    ("[parallelism]\npipeline_parallel_split_points = [1, 2]\n", ["pipeline_parallel_split_points", "str"]),
    ('[parallelism]\npipeline_parallel_split_points = "layers.1"\n', ["pipeline_parallel_split_points", "list"]),
    ("training = 3\n", ["[training]", "must be a table"]),
    ("[training]\ndataloader = 3\n", ["[training] dataloader", "must be a table"]),
    ("[model.overrides]\ndim = [1]\n", ["[model] overrides", "single number"]),
    ('[job]\nconfig_file = "x.toml"\n', ["config_file", "command line"]),
    ("extends = 3\n", ["extends", "file name"]),
    ('extends = "missing.toml"\n', ["not found", "missing.toml"]),
    ("[model]\ntie_embeddings = \"yes\"\n", ["[model] tie_embeddings"]),
]


@pytest.mark.parametrize("text, words", TOML_ERRORS, ids=[t.replace("\n", " ") for t, _ in TOML_ERRORS])
def test_toml_errors_name_the_key_and_file(tmp_path, text, words):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message.strip()
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    if "extends" not in text and "malformed" not in words[0]:
        assert "bad.toml" in message  # where the value came from


def test_every_unknown_key_of_a_file_is_reported_at_once(tmp_path):
    """Four misspellings in one file: four errors, one line each, in file order, none lost; a
    well-formed key between them is still read (its value is checked like any other)."""
    from trainer.errors import ConfigErrors, error_lines

    path = write(tmp_path, "bad.toml", '[job]\ndescriptin = "x"\n[training]\nstep = 3\nsteps = 4\nlr = 1\n'
                                       '[optimiser]\nlr = 1\n')
    with pytest.raises(ConfigErrors) as info:
        load_config(path)
    lines = error_lines(info.value)
    assert [line.split(":")[0] for line in lines] == ["[job] descriptin", "[training] step", "[training] lr",
                                                      "[optimiser]"]
    assert all("bad.toml" in line and "\n" not in line for line in lines)
    assert "did you mean [optimizer] lr?" in lines[2]


def test_extends_cycle(tmp_path):
    write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle.*a.toml.*b.toml.*a.toml"):
        load_config(tmp_path / "a.toml")


def test_self_extends_cycle(tmp_path):
    write(tmp_path, "a.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.toml")


def test_world_size_checks_name_the_arithmetic():

    overrides = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.tensor_parallel_degree", "4"]
    with pytest.raises(ConfigError, match=r"dp_replicate 2 \* dp_shard 2 \* cp 1 \* tp 4 \* pp 1 = 16 != WORLD_SIZE 8"):
        load_plan(overrides, 8)
    with pytest.raises(ConfigError, match="does not divide WORLD_SIZE 6"):
        load_plan(["--parallelism.tensor_parallel_degree", "4"], 6)
    with pytest.raises(ConfigError, match="local_batch_size 8 \\* data-parallel degree 2 = 16"):
        load_plan(["--training.global_batch_size", "24"], 2)


# -- fuzzing: a few hundred malformed inputs, each must give a ConfigError (never a crash) ---------

ALL_KEYS = [
    ".".join(path + (name,)) for path, fields in walk_sections(JobConfig) for name in fields
]
JUNK = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["-1", "0", "1e999", "nan", "[", "[1,", '["a", 1]', "true", "{}", "1_0", "0x10", "", " "]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.sampled_from(ALL_KEYS), st.text(min_size=1, max_size=20)),
    value=JUNK,
    form=st.sampled_from(["space", "equals", "bare"]),
)
@example(key="job.config_file", value="\n0", form="space")  # found by this test: a newline in a quoted file name
def test_fuzz_cli_never_crashes(key, value, form):
    argv = {"space": [f"--{key}", value], "equals": [f"--{key}={value}"], "bare": [f"--{key}"]}[form]
    try:
        load_plan(argv)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e).strip()


TOML_PIECES = st.sampled_from(
    ["[training]", "[model]", "[parallelism]", "[training.dataloader]", "[model.overrides]", "[nope]", "steps = 3",
     'steps = "x"', "lr = -1", "seq_len = 0", "name = 3", "x = [", "= 1", "dim = 64", "flavor = 'z'",
     "local_batch_size = 1.5", "enable = true", "tensor_parallel_degree = 5", "[[training]]", "a.b = 1", '"', ""]
)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=st.lists(TOML_PIECES, max_size=6))
def test_fuzz_toml_never_crashes(tmp_path, lines):
    path = tmp_path / "fuzz.toml"
    path.write_text("\n".join(lines) + "\n")
    try:
        load_config(path)
    except ConfigError as e:
        assert str(e)


def test_every_field_has_a_default_and_doc():
    JobConfig()  # constructs without arguments: every field has a default
    for path, fields in walk_sections(JobConfig):
        for name, spec in fields.items():
            assert spec.doc, ".".join(path + (name,))
