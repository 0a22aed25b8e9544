"""Console and TensorBoard metrics: loss, grad norm, lr, throughput, MFU, memory."""

import collections
import functools
import logging
import math
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config.schema import Metrics
from trainer.errors import UserError

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s of one device, by a substring of its name.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12, "MI300X": 1307e12}


def peak_flops(device: torch.device, configured: float) -> float:
    """Peak FLOP/s for MFU: ``[metrics] peak_flops`` if set, else a table lookup of accelerators, else on CPU
    a short float32 matmul measurement (``measured_cpu_peak``); 0 = unknown."""
    if configured:
        return configured
    if device.type == "cpu":
        peak = measured_cpu_peak()
        logger.info("MFU against this CPU's measured float32 matmul rate, %.1f GFLOP/s on %d threads (the fastest"
                    " 512 x 512 or 1024 x 1024 matmul on one thread, times the threads; set [metrics] peak_flops to"
                    " use another peak)", peak / 1e9, torch.get_num_threads())
        return peak
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _PEAK_FLOPS.items():
            if key in name:
                return value
        logger.warning("peak FLOP/s of %r unknown; set [metrics] peak_flops to report MFU", name)
    return 0.0


def measured_cpu_peak(sizes: tuple[int, ...] = (512, 1024), repeats: int = 5) -> float:
    """FLOP/s of float32 square matmuls (each of ``sizes``) on this process's threads: one thread's fastest of
    ``repeats`` after one warm-up, at the size that runs fastest, times the process's threads (~0.1 s, paid once
    per process). A practical peak: what the step's matmuls could reach. One thread, the fastest run: other work
    at start-up can hold a core, which halves a matmul spread over every thread and slows some runs; a peak read
    that way would put the model's MFU above 100%."""
    return _one_thread_peak(sizes, repeats) * torch.get_num_threads()


@functools.lru_cache(maxsize=2)
def _one_thread_peak(sizes: tuple[int, ...], repeats: int) -> float:
    threads = torch.get_num_threads()
    best = 0.0
    torch.set_num_threads(1)
    try:
        for size in sizes:
            a, b = torch.randn(size, size), torch.randn(size, size)
            for i in range(repeats + 1):
                start = time.perf_counter()
                a @ b
                seconds = time.perf_counter() - start
                if i and seconds > 0:
                    best = max(best, 2 * size**3 / seconds)
    finally:
        torch.set_num_threads(threads)
    return best


def memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: accelerator memory allocated, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "gpu_peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "rss_peak"  # ru_maxrss is KiB


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def readable_names(names: list[str]) -> list[str]:
    """Each name's last path part (``/data/web-prepared/`` -> ``web-prepared``); where two would be the same,
    the whole names with their slashes replaced."""
    short = [Path(n.rstrip("/")).name or n for n in names]
    if len(set(short)) < len(short):
        return [n.strip("/").replace("/", "_") for n in names]
    return short


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float


class MetricsLogger:
    """Writes a console line and TensorBoard scalars every ``log_freq`` steps.

    Only the rank chosen to report (``enabled``) writes; every rank must still call
    ``log`` so that throughput windows stay aligned.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        dump_folder: str,
        enabled: bool,
        device: torch.device,
        flops_per_token: float,
        dp_degree: int,
        world_size: int,
        config_toml: str = "",
        total_steps: int = 0,
    ):
        self.log_freq = metrics.log_freq
        self.enabled = enabled
        self.device = device
        self.flops_per_token = flops_per_token
        self.dp_degree, self.world_size = dp_degree, world_size
        self.peak = peak_flops(device, metrics.peak_flops) if enabled else 0.0
        self.total_steps = total_steps
        self.writer: _Writers | None = None
        self._tensorboard = enabled and metrics.enable_tensorboard
        self._wandb = enabled and metrics.enable_wandb
        self._tb_root, self._config_toml = Path(dump_folder) / metrics.save_tb_folder, config_toml
        self._started = False
        self._run_start = time.monotonic()
        self._step_seconds: collections.deque[float] = collections.deque(maxlen=20)  # recent windows, per step
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._window_steps = 0

    def start(self, resumed_step: int = 0) -> None:
        """Open this run's TensorBoard folder: ``<save_tb_folder>/<YYYYmmdd-HHMMSS>``, one per run; a run that
        resumes a checkpoint (``resumed_step`` > 0) continues the newest one, so its curve goes on."""
        if self._started:
            return
        self._started = True
        self._run_start = time.monotonic()
        if not (self._tensorboard or self._wandb):
            return
        runs = sorted(p for p in self._tb_root.glob("*") if p.is_dir()) if self._tb_root.is_dir() else []
        continued = resumed_step > 0 and bool(runs)
        if continued:
            self.tb_dir = runs[-1]
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.tb_dir = self._tb_root / stamp
            n = 2
            while self.tb_dir.exists():  # two runs started within a second
                self.tb_dir, n = self._tb_root / f"{stamp}-{n}", n + 1
        self.tb_dir.mkdir(parents=True, exist_ok=True)
        sinks = []
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            sinks.append(SummaryWriter(log_dir=str(self.tb_dir)))
            if self._config_toml:
                sinks[0].add_text("config", "```toml\n" + self._config_toml + "\n```", resumed_step)
            logger.info("TensorBoard: %s (%s)", self.tb_dir, "continued" if continued else "new run")
        if self._wandb:
            sinks.append(WandbWriter(self.tb_dir, self._config_toml))
        self.writer = _Writers(sinks)

    def should_log(self, step: int) -> bool:
        return step % self.log_freq == 0 or step == 1

    def log(self, stats: StepStats, tokens: int) -> dict[str, float]:
        """Record one step; ``tokens`` is the number this rank's data-parallel replica trained on in it
        (its TP/PP peers share the same tokens)."""
        self.start()
        self._window_tokens += tokens
        self._window_steps += 1
        if not self.should_log(stats.step):
            return {}
        elapsed = time.perf_counter() - self._window_start
        self._step_seconds.append(elapsed / self._window_steps)
        # Data-parallel replicas see different tokens; the TP/PP peers of a replica share its tokens,
        # so the job's rate is dp replicas' worth, spread over every device of the job.
        job_tps = self._window_tokens / elapsed * self.dp_degree
        tps = job_tps / self.world_size
        values = {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "tokens_per_second_per_device": tps,
            "tokens_per_second": job_tps,
            "step_time_s": elapsed / self._window_steps,
        }
        if self.peak:
            values["mfu_percent"] = 100.0 * tps * self.flops_per_token / self.peak
        mem, mem_name = memory_gib(self.device)
        values[f"memory_{mem_name}_gib"] = mem
        self._window_start, self._window_tokens, self._window_steps = time.perf_counter(), 0, 0
        if self.enabled:
            mfu = f"  mfu {values['mfu_percent']:5.2f}%" if "mfu_percent" in values else ""
            progress, timing = f"step {stats.step:5d}", ""
            if self.total_steps:
                left = max(self.total_steps - stats.step, 0)
                eta = statistics.median(self._step_seconds) * left
                progress = f"step {stats.step:{len(str(self.total_steps))}d}/{self.total_steps}"
                timing = f"  elapsed {_clock(time.monotonic() - self._run_start)}  eta {_clock(eta)}"
            logger.info(
                "%s  loss %8.4f  grad_norm %8.4f  lr %.3e  tok/s %10.0f (%.0f/device)%s  step_time %.3fs%s  %s %.2fGiB",
                progress, stats.loss, stats.grad_norm, stats.lr, values["tokens_per_second"], tps, mfu,
                values["step_time_s"], timing, mem_name, mem,
            )
            if self.writer is not None:
                for name, value in values.items():
                    self.writer.add_scalar(name, value, stats.step)
        return values

    def log_model(self, family: str, values: dict[str, float], step: int) -> None:
        """A model family's per-layer metrics (``name/layerN``): TensorBoard ``family/name/layerN``,
        and on the console the mean and the worst layer of each name."""
        if not self.enabled or not values:
            return
        by_name: dict[str, dict[str, float]] = {}
        for key, value in values.items():
            name, _, layer = key.partition("/")
            by_name.setdefault(name, {})[layer] = value
        summary = []
        for name, layers in by_name.items():
            worst = max(layers, key=layers.get)
            summary.append(f"{name} mean {sum(layers.values()) / len(layers):.4g} max {layers[worst]:.4g} ({worst})")
        logger.info("%s step %5d  %s", family, step, "  |  ".join(summary))
        self.log_scalars(family, values, step)

    def log_validation(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        self._window_start += seconds  # evaluation time is not training throughput
        if not self.enabled:
            return
        perplexity = math.exp(min(loss, 700.0))
        logger.info("validate step %5d  loss %8.4f  perplexity %10.3f  (%d tokens, %.2fs)",
                    step, loss, perplexity, tokens, seconds)
        if self.writer is not None:
            self.writer.add_scalar("validation/loss", loss, step)
            self.writer.add_scalar("validation/perplexity", perplexity, step)

    def log_scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars ``prefix/<name>`` (e.g. each dataset's share of the windows so far); a name that
        is a path is shown by its last part (``data_share/web-prepared``, not ``data_share//data/web-prepared``)."""
        if self.writer is not None:
            for name, value in zip(readable_names(list(values)), values.values(), strict=True):
                self.writer.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _Writers:
    """Every enabled metrics sink (TensorBoard's SummaryWriter, ``WandbWriter``) behind SummaryWriter's methods."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def add_scalar(self, name: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.add_scalar(name, value, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class WandbWriter:
    """Weights & Biases as a metrics sink: one W&B run per run folder (``run_dir``), continued by a resumed run
    (its id is kept in ``run_dir/wandb_run_id``); the resolved config goes in as the run's config."""

    def __init__(self, run_dir: Path, config_toml: str):
        import tomllib
        import uuid

        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        try:
            self.run = wandb.init(dir=str(run_dir), id=run_id, resume="allow", name=run_dir.name,
                                  config=tomllib.loads(config_toml) if config_toml else None)
        except Exception as e:  # noqa: BLE001 (not logged in, no network, a bad WANDB_* value: all the user's to fix)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"[metrics] enable_wandb: Weights & Biases did not start: {first} (log in with"
                            " `wandb login`, or set WANDB_MODE=offline)") from None
        id_file.write_text(run_id + "\n")
        logger.info("Weights & Biases: run %s in %s", run_id, run_dir)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
