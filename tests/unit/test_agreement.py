"""What ranks compare at start (trainer/agreement.py): every config key, the plan's files, the split; and the line
every rank stops with when one differs."""

import dataclasses

from trainer.agreement import MEMORY_ENTRY, SHOWN, SPLIT_ENTRY, first_disagreement
from trainer.config import JobConfig, load_config
from trainer.config.render import config_fingerprint, walk_sections


def with_parallelism(config, **changes):
    return dataclasses.replace(config, parallelism=dataclasses.replace(config.parallelism, **changes))


def test_every_config_key_is_compared_but_the_config_files_own_path():
    entries = config_fingerprint(load_config(overrides=[]))
    expected = {f"[{'.'.join(path)}] {name}" for path, fields in walk_sections(JobConfig) for name in fields}
    # the config file's path and the paths whose contents the same-data check compares may differ by node
    assert set(entries) == expected - {"[job] config_file", "[training] dataset_path", "[validation] dataset_path",
                                       "[model] tokenizer_path"}
    # a value is its TOML form, so a change of any kind shows: here an int, a bool, a list
    for args, key in [(["--training.steps", "7"], "[training] steps"),
                      (["--metrics.no-enable_tensorboard"], "[metrics] enable_tensorboard"),
                      (["--parallelism.pipeline_parallel_split_points", "layers.2"],
                       "[parallelism] pipeline_parallel_split_points")]:
        other = config_fingerprint(load_config(overrides=args))
        assert [k for k in entries if other[k] != entries[k]] == [key]


def test_a_tables_entries_compare_in_key_order():
    n_layers, dim = ["--model.overrides.n_layers", "4"], ["--model.overrides.dim", "64"]
    one, other = (config_fingerprint(load_config(overrides=args)) for args in (n_layers + dim, dim + n_layers))
    assert one == other and one["[model] overrides"] == "{dim = 64, n_layers = 4}"


def test_the_plans_files_are_compared_by_their_contents(tmp_path):
    costs, schedule = tmp_path / "costs.json", tmp_path / "schedule.csv"
    costs.write_text('{"a": 1}')
    schedule.write_text("0F0,0B0\n")
    config = with_parallelism(load_config(overrides=[]), pipeline_parallel_cost_file=str(costs),
                              pipeline_parallel_schedule_csv=str(schedule))
    before = config_fingerprint(config)
    costs.write_text('{"a": 2}')  # the same path, other contents: as on another node
    after = config_fingerprint(config)
    key = f"[parallelism] pipeline_parallel_cost_file (contents of {costs})"
    assert [k for k in before if before[k] != after[k]] == [key]
    assert f"[parallelism] pipeline_parallel_schedule_csv (contents of {schedule})" in before
    message = first_disagreement([before, after])
    assert message.startswith(f"{key}: ranks [1] have {after[key]} where rank 0 has {before[key]}")
    assert "(different files at the same path on different nodes?)" in message
    costs.unlink()
    assert config_fingerprint(config)[key].startswith("unreadable")


def test_equal_ranks_agree_and_the_first_difference_in_rank_0s_order_is_named():
    base = {**config_fingerprint(load_config(overrides=[])), SPLIT_ENTRY: '["layers.3"]'}
    assert first_disagreement([base, dict(base), dict(base)]) is None
    # ranks 1 and 3 of 4 differ in a key and in the split; the key comes first (it is the cause)
    other = {**base, "[training] steps": "9", SPLIT_ENTRY: '["layers.4"]'}
    message = first_disagreement([base, other, dict(base), other])
    assert message.startswith(f"[training] steps: ranks [1, 3] have 9 where rank 0 has {base['[training] steps']}")
    assert message.endswith("(another config file or command line on their nodes?); every rank must run the same job")
    # config keys before file contents (alphabetically "[parallelism] ..." would come before "[training] ...")
    contents = "[parallelism] pipeline_parallel_cost_file (contents of costs.json)"
    base[contents] = "sha256 1"
    message = first_disagreement([base, {**base, contents: "sha256 2", "[training] steps": "9"}])
    assert message.startswith("[training] steps: ranks [1] have 9")


def test_another_split_from_the_same_inputs_names_the_split_points_key_and_rank_0s_split():
    base = {**config_fingerprint(load_config(overrides=[])), SPLIT_ENTRY: '["layers.3"]'}
    message = first_disagreement([base, {**base, SPLIT_ENTRY: '["layers.4"]'}])
    assert message.startswith('[parallelism] pipeline_parallel_split_points: ranks [1] planned the split ["layers.4"]'
                              " from the same config and files as rank 0")
    assert message.endswith('pipeline_parallel_split_points = ["layers.3"] runs rank 0\'s split on all')


def test_another_split_within_another_devices_memory_names_the_memory_limit():
    """With pipeline_parallel_memory_limit_gib = 0 each rank's split search is limited by its own device: a node with
    smaller devices may plan another split, and the line says so (the same memory: the split line as above)."""
    base = {**config_fingerprint(load_config(overrides=[])), SPLIT_ENTRY: '["layers.3"]'}
    other = {**base, SPLIT_ENTRY: '["layers.4"]'}
    memory = [{MEMORY_ENTRY: "80.00 GiB"}, {MEMORY_ENTRY: "40.00 GiB"}]
    assert first_disagreement([base, other], memory) == (
        '[parallelism] pipeline_parallel_memory_limit_gib: ranks [1] planned the split ["layers.4"] within their'
        ' device\'s memory of 40.00 GiB where rank 0 planned ["layers.3"] within 80.00 GiB (0 = each rank\'s own'
        " device); set it to the smallest device's to plan alike")
    same = first_disagreement([base, other], [memory[0], memory[0]])
    assert same == first_disagreement([base, other]) and same.startswith("[parallelism] pipeline_parallel_split_points")


def test_a_key_only_one_side_has_is_missing_on_the_other_and_long_values_are_shortened():
    base = {"[a] x": "1"}
    message = first_disagreement([base, {**base, "[b] new": "2"}])
    assert message.startswith("[b] new: ranks [1] have 2 where rank 0 has missing")
    long = "x" * (SHOWN + 50)
    message = first_disagreement([base, {"[a] x": long}])
    assert f"have {long[:SHOWN - 3]}... where" in message and long not in message
