"""Shared helpers: tiny configs that run in about a second on one CPU core."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # tests must never reach the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process (the test processes, and what they start, unless a test says otherwise): the tiny models run
# faster on one thread than on two, and under `pytest -n 2` a second thread in each worker oversubscribes the cores
# (measured: test_families 31 s on one thread, 37 s on two alone, 96 s on two beside the other worker).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(REPO / "tests" / "fixtures"))  # custom model families for registry tests

# The device the tests run on. CI's expectations (golden losses, parity bounds) are float32 on the CPU, so on a
# machine with a GPU the suite hides it unless asked: TRAINER_TEST_DEVICE=cuda runs it there (single-process tests:
# `-m "not slow"`; multi-rank tests would need a GPU per rank). Read before anything initialises CUDA.
TEST_DEVICE = os.environ.get("TRAINER_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_configure(config):
    if TEST_DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"TRAINER_TEST_DEVICE={TEST_DEVICE}: use cpu (the default) or cuda")
    if TEST_DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("TRAINER_TEST_DEVICE=cuda, but torch sees no CUDA device here")
    config.addinivalue_line("markers", "cpu_only(reason): expects the CPU's float32 numbers; skipped on CUDA")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; collected only with TRAINER_TEST_DEVICE=cuda")


def pytest_collection_modifyitems(config, items):
    """CUDA tests are left out of a CPU run (deselected, not skipped: CI has no GPU to wait for); CPU-only
    tests are skipped, with their reason, in a CUDA run."""
    if TEST_DEVICE == "cpu":
        cuda = [item for item in items if item.get_closest_marker("cuda")]
        if cuda:
            config.hook.pytest_deselected(items=cuda)
            items[:] = [item for item in items if not item.get_closest_marker("cuda")]
        return
    for item in items:
        mark = item.get_closest_marker("cpu_only")
        if mark is not None:
            item.add_marker(pytest.mark.skip(reason=f"TRAINER_TEST_DEVICE={TEST_DEVICE}: {mark.args[0]}"))

# A 2-layer, dim-64 Llama with a 512-token vocabulary ...
TINY_MODEL = [
    "--model.overrides.dim", "64", "--model.overrides.n_layers", "2", "--model.overrides.n_heads", "4",
    "--model.overrides.n_kv_heads", "2", "--model.overrides.vocab_size", "512",
]
# ... on 32-token sequences, 4 steps.
TINY_RUN = [
    "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "4",
    "--lr_scheduler.warmup_steps", "1", "--metrics.no-enable_tensorboard", "--debug.deterministic",
]


@pytest.fixture
def tiny_run_args(tmp_path):
    """Overrides for a tiny run (any model) that writes into a temporary dump folder."""
    return TINY_RUN + ["--job.dump_folder", str(tmp_path / "run")]


@pytest.fixture
def tiny_args(tiny_run_args):
    """Overrides for a tiny Llama run."""
    return TINY_MODEL + tiny_run_args


def pytest_sessionfinish(session):
    """Under pytest-xdist (-n): a worker hands its parity lines to the controller, which prints them."""
    from tests.parity import REPORT

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["parity_report"] = list(REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from tests.parity import REPORT

    REPORT.extend(getattr(node, "workeroutput", {}).get("parity_report", []))


def pytest_terminal_summary(terminalreporter):
    """The worst per-tensor relative difference of every parity case run (tests/parity.py)."""
    from tests.parity import REPORT

    if REPORT:
        terminalreporter.section("parity: worst tensor per case (||a - b|| / ||b||)")
        for line in REPORT:
            terminalreporter.write_line(line)


def load_plan(overrides: list[str], world_size: int | None = None, config_file=None, check_memory: bool = True):
    """Config + job plan, as a run builds them (model-level checks happen in the plan); the world
    size defaults to the product of the configured degrees. ``check_memory=False`` plans, like the
    dry run, for machines bigger than this one."""
    from trainer.config import load_config
    from trainer.plan import build_job_plan

    config = load_config(config_file, overrides)
    if world_size is None:
        p = config.parallelism
        world_size = (p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1)
                      * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return build_job_plan(config, world_size, check_memory=check_memory)


@pytest.fixture
def launch_tmp(tmp_path):
    """A temporary folder of a launch's own (``TMPDIR``, which tempfile and so torchrun read): torchrun makes its
    log folder ``torchelastic_*`` there, and a test checks that none is left, whatever other tests launch at the
    same time (pytest -n). ``.env``: the variables to add; ``.left()``: the torchrun folders left there."""
    folder = tmp_path / "launch_tmp"
    folder.mkdir()

    class LaunchTmp:
        env = {"TMPDIR": str(folder)}

        @staticmethod
        def left() -> list[Path]:
            return sorted(folder.glob("torchelastic_*"))

    return LaunchTmp()
