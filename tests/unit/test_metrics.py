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
