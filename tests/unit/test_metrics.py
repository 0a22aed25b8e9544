"""Throughput and MFU are per device of the whole job, whatever the layout."""

import pytest
import torch

import trainer.metrics as metrics_mod
from trainer.config.schema import Metrics
from trainer.metrics import MetricsLogger, StepStats


@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)])
def test_tokens_per_device_and_mfu_count_every_device(dp, tp, pp, monkeypatch, tmp_path):
    clock = iter([0.0, 2.0, 2.0])  # the window opens at 0 s; the step is logged at 2 s
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    logger = MetricsLogger(Metrics(enable_tensorboard=False, peak_flops=1e9), dump_folder=str(tmp_path), enabled=True,
                           device=torch.device("cpu"), flops_per_token=1e4, dp_degree=dp, world_size=dp * tp * pp)
    # One replica trained on 1000 tokens in 2 s; each of the dp replicas did the same.
    values = logger.log(StepStats(1, 5.0, 1.0, 1e-3), tokens=1000)
    job = 500.0 * dp
    per_device = job / (dp * tp * pp)
    assert values["tokens_per_second"] == pytest.approx(job)
    assert values["tokens_per_second_per_device"] == pytest.approx(per_device)
    # MFU: each device's share of the model FLOPs against one device's peak.
    assert values["mfu_percent"] == pytest.approx(100 * per_device * 1e4 / 1e9)


def test_step_line_shows_progress_elapsed_and_eta(monkeypatch, tmp_path, caplog):
    """Steps of 1 s each: at step 2 of 10, eight steps are left, so 8 s (median of the recent steps)."""
    clock = iter([0.0, 1.0, 1.0, 2.0, 2.0])  # window opens at 0; steps logged at 1 s and 2 s
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(metrics_mod, "measured_cpu_peak", lambda: 1e12)  # (it would read the clock)
    logger = MetricsLogger(Metrics(enable_tensorboard=False), dump_folder=str(tmp_path), enabled=True,
                           device=torch.device("cpu"), flops_per_token=1e4, dp_degree=1, world_size=1, total_steps=10)
    with caplog.at_level("INFO"):
        logger.log(StepStats(1, 5.0, 1.0, 1e-3), tokens=100)
        logger.log(StepStats(2, 4.0, 1.0, 1e-3), tokens=100)
    line = caplog.records[-1].getMessage()
    assert line.startswith("step  2/10  loss") and "eta 0:00:08" in line and "elapsed 0:00:0" in line


def test_each_run_gets_its_own_tensorboard_folder_and_a_resume_continues_it(tmp_path, caplog):
    caplog.set_level("INFO")
    def run(resumed_step):
        logger = MetricsLogger(Metrics(), dump_folder=str(tmp_path), enabled=True, device=torch.device("cpu"),
                               flops_per_token=1.0, dp_degree=1, world_size=1, config_toml="[job]\n")
        logger.start(resumed_step)
        logger.close()
        return logger.tb_dir

    first, second = run(0), run(0)
    assert first != second and first.parent == second.parent == tmp_path / "tb"  # two runs, two folders
    assert run(5) == second  # a resumed run continues the newest run's curve
    assert f"TensorBoard: {second} (continued)" in caplog.text


def test_tensorboard_tags_of_paths_are_their_last_part():
    assert metrics_mod.readable_names(["/tmp/byo/txt-prepared", "python_docs", "data/web/"]) == [
        "txt-prepared", "python_docs", "web"]
    assert metrics_mod.readable_names(["a/web", "b/web"]) == ["a_web", "b_web"]  # the same last part: whole names


def test_mfu_on_cpu_is_against_a_measured_matmul_rate_unless_a_peak_is_set(monkeypatch, caplog):
    """On CPU no table knows the peak: a float32 matmul is timed at start (said in one line); a configured
    [metrics] peak_flops wins without measuring; a rank that does not report measures nothing."""
    import logging

    caplog.set_level(logging.INFO)
    # Each matmul's time is what the clock says, whatever this machine does: 512 x 512 after a warm-up of 9 ms
    # once in 1 ms, else 3 ms (the machine busy elsewhere most of the time); 1024 x 1024 always in 10 ms. The peak
    # is one thread's fastest run at the faster size, 2 * 512^3 FLOP in 1 ms (a median would say a third of
    # that), times the process's threads; the matmuls run on one thread, and the threads are set back after.
    threads = 2
    state = {"threads": threads}
    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: state.update(threads=n))
    durations = [9e-3, 3e-3, 3e-3, 1e-3, 3e-3, 3e-3] + [10e-3] * 6
    times = iter([x for d in durations for x in (0.0, d)])
    clock, timed_on = metrics_mod.time.perf_counter, set()
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: (timed_on.add(state["threads"]), next(times))[1])
    assert 2 * 1024**3 / 10e-3 < 2 * 512**3 / 1e-3
    metrics_mod._one_thread_peak.cache_clear()  # measured once per process: maybe already, by another test
    assert metrics_mod.peak_flops(torch.device("cpu"), 0.0) == pytest.approx(threads * 2 * 512**3 / 1e-3)
    assert next(times, None) is None  # every run timed: one warm-up and five per size
    assert timed_on == {1} and state["threads"] == threads
    state["threads"] = 4  # the next job of the process: the same one-thread rate, times its threads, not timed again
    assert metrics_mod.peak_flops(torch.device("cpu"), 0.0) == pytest.approx(4 * 2 * 512**3 / 1e-3)
    state["threads"] = threads
    monkeypatch.setattr(metrics_mod.time, "perf_counter", clock)
    assert "measured float32 matmul rate, 536.9 GFLOP/s on 2 threads" in caplog.text
    monkeypatch.setattr(metrics_mod, "measured_cpu_peak", lambda: pytest.fail("measured although configured"))
    assert metrics_mod.peak_flops(torch.device("cpu"), 5e9) == 5e9
    silent = MetricsLogger(Metrics(enable_tensorboard=False), dump_folder="unused", enabled=False,
                           device=torch.device("cpu"), flops_per_token=1e4, dp_degree=1, world_size=1)
    assert silent.peak == 0.0


class FakeWandb:
    """Stands in for the wandb package: records init arguments, logged values and finish."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logged.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()


def test_weights_and_biases_gets_every_scalar_and_a_resume_continues_its_run(monkeypatch, tmp_path):
    import sys

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics_mod, "measured_cpu_peak", lambda: 1e12)

    def run(resumed_step):
        logger = MetricsLogger(Metrics(enable_wandb=True, enable_tensorboard=False), dump_folder=str(tmp_path),
                               enabled=True, device=torch.device("cpu"), flops_per_token=1.0, dp_degree=1,
                               world_size=1, config_toml="[training]\nsteps = 3\n")
        logger.start(resumed_step)
        logger.log(StepStats(resumed_step + 1, 5.0, 1.0, 1e-3), tokens=100)
        logger.log_validation(resumed_step + 1, 4.5, 100, 0.1)
        logger.close()
        return logger.tb_dir

    first = run(0)
    assert fake.inits[0]["dir"] == str(first) and fake.inits[0]["config"] == {"training": {"steps": 3}}
    logged = {name for step, values in fake.logged if step == 1 for name in values}
    assert {"loss", "grad_norm", "lr", "tokens_per_second", "validation/loss", "validation/perplexity"} <= logged
    assert run(1) == first and fake.inits[1]["id"] == fake.inits[0]["id"]  # the resumed run continues it
    assert run(0) != first and fake.inits[2]["id"] != fake.inits[0]["id"] and fake.finished == 3  # a new W&B run


def test_weights_and_biases_without_the_package_is_one_line_naming_the_key(monkeypatch):
    import importlib.util

    from trainer.config import load_config
    from trainer.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"\[metrics\] enable_wandb: the wandb package is not installed"):
        load_config(overrides=["--metrics.enable_wandb"])


def test_weights_and_biases_that_cannot_start_is_one_line_naming_the_key(monkeypatch, tmp_path):
    import sys

    from trainer.errors import UserError

    fake = FakeWandb()

    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)\nmore detail")

    fake.init = refuse
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics_mod, "measured_cpu_peak", lambda: 1e12)
    logger = MetricsLogger(Metrics(enable_wandb=True, enable_tensorboard=False), dump_folder=str(tmp_path),
                           enabled=True, device=torch.device("cpu"), flops_per_token=1.0, dp_degree=1, world_size=1)
    with pytest.raises(UserError, match=r"^\[metrics\] enable_wandb: Weights & Biases did not start: api_key not"
                                        r" configured \(no-tty\) \(log in"):
        logger.start(0)
