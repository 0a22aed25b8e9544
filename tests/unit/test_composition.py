"""docs/parallelism.md's composition table is the one derived from the code and the parity suite
(tests/composition.py): every "yes" names a parity case whose plan runs both techniques, every "no" quotes the
plan's refusal of a job with both, and no pair is left untested."""

from pathlib import Path

import pytest

from tests.composition import FEATURES, composition, markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
BEGIN, END = "<!-- composition table: python -m tests.composition -->", "<!-- end of the composition table -->"


@pytest.fixture(scope="module")
def table():
    return composition()


def test_the_docs_hold_the_derived_table(table):
    text = DOCS.read_text()
    held = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n") + "\n"
    assert held == markdown(*table), "docs/parallelism.md's table is stale: python -m tests.composition"


def test_every_pair_is_proven_or_refused(table):
    names, cells = table
    assert len(cells) == len(FEATURES) * (len(FEATURES) + 1) // 2
    assert [pair for pair, cell in cells.items() if cell == "untested"] == []
    assert all(cell.startswith(("yes: ", "no: ")) or cell == "-" for cell in cells.values())
    # a feature alone is always proven
    assert all(cells[n, n].startswith("yes: ") for n in names)


def test_a_yes_needs_both_features_in_the_named_case(table):
    """The table is not a list typed by hand: dropping a case's technique removes its "yes" (here, every case that
    runs context parallelism with activation checkpointing, planned as if CP were off)."""
    import tests.composition as comp

    names, cells = table
    assert cells["CP", "AC full"].startswith("yes: ")
    cp = next(f for f in FEATURES if f.name == "CP")
    blind = [f if f is not cp else comp.Feature("CP", cp.settings, lambda plan: False) for f in FEATURES]
    original = comp.FEATURES
    comp.FEATURES = blind
    try:
        _, broken = comp.composition()
    finally:
        comp.FEATURES = original
    assert not broken["CP", "AC full"].startswith("yes: ")


def test_tied_embeddings_with_pipeline_and_tensor_parallelism_are_refused_naming_the_keys():
    """A three-way refusal the pair table cannot show (each pair of the three composes)."""
    from tests.conftest import load_plan
    from trainer.errors import ConfigError

    args = ["--model.tie_embeddings", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.tensor_parallel_degree", "2", "--model.overrides.n_layers", "4"]
    with pytest.raises(ConfigError, match=r"\[model\] tie_embeddings with \[parallelism\] pipeline_parallel_degree=2"
                                          r" and tensor_parallel_degree=2: not supported yet"):
        load_plan(args, 4)
    load_plan(args[1:], 4)  # untied, it plans


def test_context_parallelism_with_a_whole_sequence_loss_is_refused_naming_the_key():
    """The MoE family's sequence-wise balance loss is computed per whole sequence: under CP each rank holds half of
    one (measured before the refusal: the router's gradient 75% off one process's). Without it, CP2 x FSDP2 is
    proven (moe: CP2xFSDP2)."""
    from tests.conftest import load_plan
    from tests.distributed.test_moe_parity import BASE
    from trainer.errors import ConfigError

    cp = ["--parallelism.context_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"context_parallel_degree=2 with a mixture of experts: the sequence-wise"
                                          r" balance loss \(\[model.overrides\] aux_loss_coef = 0.01\)"):
        load_plan(BASE + cp, 2)
    load_plan(BASE + cp + ["--model.overrides.aux_loss_coef", "0"], 2)
