"""torch.profiler traces and CUDA memory snapshots of chosen steps (``[profiling] enable_profiling``).

``StepProfiler`` (torchtitan's keys): torch.profiler records the last ``profiler_active`` steps of
every ``profile_freq`` steps (after ``profiler_warmup`` untraced ones) and writes
``<dump>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json``, a Chrome trace of that rank's CPU
operators (and device kernels on CUDA). With ``enable_memory_snapshot`` on CUDA, allocations are
recorded from the start and a snapshot is dumped every ``profile_freq`` steps to
``<dump>/<save_memory_snapshot_folder>/iteration_<N>/rank<R>_memory_snapshot.pickle``.
"""

import logging
from pathlib import Path

import torch

from trainer.config.schema import Profiling

logger = logging.getLogger(__name__)


class StepProfiler:
    """torch.profiler over chosen steps, and CUDA memory snapshots; call ``step(n)`` after each step."""

    def __init__(self, profiling: Profiling, dump_folder: str, *, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = profiling, rank, device
        self.traces = Path(dump_folder) / profiling.save_traces_folder
        self.snapshots = Path(dump_folder) / profiling.save_memory_snapshot_folder
        self.profiler = None
        self.memory = profiling.enable_memory_snapshot and device.type == "cuda"
        if profiling.enable_memory_snapshot and not self.memory:
            logger.warning("[profiling] enable_memory_snapshot needs a CUDA device; ignored on %s", device.type)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if profiling.enable_profiling:
            f, warmup, active = profiling.profile_freq, profiling.profiler_warmup, profiling.profiler_active
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=self._save_trace,
                schedule=torch.profiler.schedule(wait=f - warmup - active, warmup=warmup, active=active),
            )
            self.profiler.start()
            self.step_num = 0

    def _save_trace(self, prof) -> None:
        folder = self.traces / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        # Where the step's time went, without opening the trace: operators by their own time.
        # A diagnostic must not end the run: a failed summary is logged, the trace stays.
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        ops = folder / f"rank{self.rank}_ops.txt"
        try:
            ops.write_text(prof.key_averages().table(sort_by=by, row_limit=30, max_name_column_width=70))
        except Exception as e:  # noqa: BLE001 (anything the summary raises)
            logger.warning("operator summary of step %d not written: %s", self.step_num, e)
            ops = "not written"
        logger.info("profiler trace of step %d: %s (operators by self time: %s)", self.step_num,
                    folder / f"rank{self.rank}_trace.json", ops)

    def step(self, step: int) -> None:
        if self.profiler is not None:
            self.step_num = step
            self.profiler.step()
        if self.memory and step % self.cfg.profile_freq == 0:
            folder = self.snapshots / f"iteration_{step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(folder / f"rank{self.rank}_memory_snapshot.pickle"))

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
