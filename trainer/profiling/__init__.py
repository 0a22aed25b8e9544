"""Profiling, one module per tool: torch.profiler steps and memory snapshots (``steps``), measured pipeline
timelines and their picture (``timeline``), the meter of what autograd saves for backward (``activations``)."""

from trainer.profiling.activations import SavedActivationMeter
from trainer.profiling.steps import StepProfiler
from trainer.profiling.timeline import PipelineTimeline, merge_timeline, timeline_svg

__all__ = ["PipelineTimeline", "SavedActivationMeter", "StepProfiler", "merge_timeline", "timeline_svg"]
