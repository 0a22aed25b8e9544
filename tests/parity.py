"""The parity instrument: every parameter's gradient (each step) and value (after the last step),
under its whole-model name, compared tensor by tensor with a single-process run.

Loss and total grad norm alone are blunt: the embedding dominates both, so a wrong gradient in a
block's norm or query projection changes them by less than float32 noise. Here every tensor is
judged on its own scale, ``||a - b|| <= rtol * ||b||``, so a small tensor cannot hide.

A run is recorded by passing a ``Recorder`` to ``trainer.train.main(config, observer=...)``: on
every rank it gathers each DTensor to a full tensor and stores it under the canonical name (the
second copy of a tied weight under the first's). Copies held by several ranks (data-parallel
replicas, tied copies on two pipeline ranks) are each compared, so copies that drift apart fail.
"""

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

RTOL = 1e-5
"""Per-tensor relative bound (fp32 on CPU over gloo; reductions differ only in summation order)."""
FLOOR = 1e-9
"""Absolute floor, as a fraction of the whole model's norm at the same step (gradients) or at the
end (parameters). A gradient that is zero in exact arithmetic holds nothing but rounding, which no
relative bound can judge: the key projection's bias of the GPT test family is one (softmax ignores
a shift shared by every key), measured at 2e-11 of the step's gradient norm in every layout."""

# Worst tensor of every case compared in this session, printed at the end of the run (conftest).
REPORT: list[str] = []

Tensors = dict[str, list[torch.Tensor]]
"""'grad/<step>/<name>' and 'param/<name>' -> the copies recorded (one per rank that holds it)."""


class Recorder:
    """A ``StepObserver`` that keeps full gradients per step and full parameters at the end."""

    def __init__(self, aliases: dict[str, str] | None = None):
        self.aliases = aliases or {}
        self.tensors: Tensors = {}

    def on_grads(self, step: int, parts) -> None:
        self._collect(parts.chunks, f"grad/{step}/", lambda p: p.grad)

    def on_end(self, parts) -> None:
        self._collect(parts.chunks, "param/", lambda p: p)
        for chunk in parts.chunks:  # the state kept in checkpoints besides parameters (a router's choosing bias)
            kept = chunk.state_dict().keys()
            for name, buffer in chunk.named_buffers():
                if name in kept and buffer.is_floating_point():
                    self.tensors.setdefault("buffer/" + name, []).append(buffer.detach().float().cpu().clone())

    def _collect(self, chunks, prefix: str, pick) -> None:
        # Every rank of a DTensor's mesh walks the same chunk in the same order, so the
        # all-gathers inside full_tensor() line up.
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                value = pick(param)
                assert value is not None, f"{name} has no gradient"
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                key = prefix + self.aliases.get(name, name)
                self.tensors.setdefault(key, []).append(value.detach().float().cpu().clone())


def tied_aliases(config) -> dict[str, str]:
    """{alias: canonical} names of the job's tied weights (empty when untied)."""
    from trainer.models import get_model_spec, import_model_modules, resolve_model_args

    import_model_modules(config.model.modules)
    spec = get_model_spec(config.model.name)
    return spec.tied_aliases(resolve_model_args(spec, config.model))


def record(config) -> tuple[object, Tensors]:
    """Train ``config`` in this process; returns (TrainResult, its tensors)."""
    from trainer.train import main

    recorder = Recorder(tied_aliases(config))
    return main(config, observer=recorder), recorder.tensors


def reference_runs(tmp_path_factory, overrides_of):
    """``get(key)``: the single-process run (``record``) of ``overrides_of(key)``, each in a dump folder of its own,
    trained once per key and module (a module-scoped fixture returns this)."""
    from trainer.config import load_config

    cache = {}

    def get(key):
        if key not in cache:
            dump = tmp_path_factory.mktemp("ref")
            cache[key] = record(load_config(overrides=[*overrides_of(key), "--job.dump_folder", str(dump)]))
        return cache[key]

    return get


def merge(records: list[Tensors]) -> Tensors:
    """All ranks' records as one (copies of a name from several ranks are kept side by side)."""
    merged: Tensors = {}
    for record in records:
        for key, copies in record.items():
            merged.setdefault(key, []).extend(copies)
    return merged


@dataclass
class Comparison:
    worst_key: str = ""
    worst_rel: float = 0.0
    failures: list[str] = field(default_factory=list)
    """One line per tensor out of bound, missing, unexpected or of another shape."""

    @property
    def ok(self) -> bool:
        return not self.failures


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (a zero reference tensor must be matched exactly)."""
    diff, scale = (a - b).norm().item(), b.norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def compare(result: Tensors, reference: Tensors, rtol: float = RTOL, floor: float = FLOOR) -> Comparison:
    """Every reference tensor against every copy in ``result``: ``||a - b|| <= rtol * ||b|| + floor * N``
    with N the norm of all reference tensors of the same step (or of all parameters)."""
    out = Comparison()
    for key in sorted(set(result) - set(reference)):
        out.failures.append(f"{key}: not in the single-process run")
    group_sq: dict[str, float] = {}
    for key, (ref, *_) in reference.items():
        group_sq[_group(key)] = group_sq.get(_group(key), 0.0) + ref.norm().item() ** 2
    for key, (ref, *_) in sorted(reference.items()):
        copies = result.get(key)
        if not copies:
            out.failures.append(f"{key}: missing")
            continue
        atol = floor * group_sq[_group(key)] ** 0.5
        for copy in copies:
            if copy.shape != ref.shape:
                out.failures.append(f"{key}: shape {tuple(copy.shape)} != {tuple(ref.shape)}")
                continue
            diff = (copy - ref).norm().item()
            if not diff <= rtol * ref.norm().item() + atol:  # also catches nan
                out.failures.append(f"{key}: relative difference {relative_error(copy, ref):.3g} > {rtol:g}")
            if diff > atol:  # differences inside the floor are rounding of a zero tensor: not ranked
                rel = relative_error(copy, ref)
                if rel > out.worst_rel or not out.worst_key:
                    out.worst_key, out.worst_rel = key, rel
    return out


def _group(key: str) -> str:
    """'grad/3/layers.0.wq.weight' -> 'grad/3'; 'param/x' -> 'param'; 'buffer/x' -> 'buffer'."""
    return key.rsplit("/", 1)[0]


def assert_parity(case: str, result: dict, reference, tensors_ref: Tensors, rtol: float = RTOL) -> Comparison:
    """Losses, grad norms and every tensor of ``result`` (a worker's dict) match the reference run."""
    import pytest

    assert result["losses"] == pytest.approx(reference.losses, rel=rtol), case
    assert result["grad_norms"] == pytest.approx(reference.grad_norms, rel=rtol), case
    # The logged norm is the norm of the run's own gradients, to float32 rounding (not a float32 accumulation);
    # the gradients themselves are compared with the reference's below.
    steps = range(1, len(reference.grad_norms) + 1)
    exact = [sum(t[0].double().norm().item() ** 2 for k, t in result["tensors"].items() if _group(k) == f"grad/{s}")
             ** 0.5 for s in steps]
    assert result["grad_norms"] == pytest.approx(exact, rel=1e-6), case
    # Validation loss after steps (PARITY enables [validation]): the same held-out windows, same weights.
    evals = {int(step): loss for step, loss in result.get("eval_losses", {}).items()}
    assert sorted(evals) == sorted(reference.eval_losses), case
    assert evals == pytest.approx(reference.eval_losses, rel=rtol), case
    cmp = compare(result["tensors"], tensors_ref, rtol)
    REPORT.append(f"{case:<34} worst {cmp.worst_rel:.2e}  {cmp.worst_key}")
    assert cmp.ok, f"{case}: {len(cmp.failures)} tensors differ:\n" + "\n".join(cmp.failures[:20])
    return cmp
