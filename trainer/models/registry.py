"""Registry of model families: ``[model] name`` picks one, ``[model] flavor`` one of its presets.

A family is a ``ModelSpec``. Register your own from any importable module and name that
module in ``[model] modules``; see docs/models.md.
"""

import dataclasses
import difflib
import importlib
import re
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from trainer.config.schema import Model
from trainer.errors import ConfigError


class HFAdapter(ABC):
    """How a family's weights and config map to a Hugging Face transformers checkpoint: subclass it and set
    ``ModelSpec.hf`` to an instance. The four abstract methods enable export (``[checkpoint] export_hf``,
    ``convert to-hf``) and loading a safetensors folder; ``from_config`` also lets an imported folder's
    config.json describe the model."""

    model_type: str = ""
    """config.json ``model_type`` of the HF class (how an imported folder names its family)."""

    @abstractmethod
    def hf_name(self, name: str) -> str:
        """Our parameter name -> the HF name."""

    @abstractmethod
    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> torch.Tensor:
        """(our name, full tensor, args) -> the tensor in HF layout."""

    @abstractmethod
    def from_hf(self, name: str, tensor: torch.Tensor, args: Any) -> torch.Tensor:
        """(our name, HF tensor, args) -> the tensor in our layout."""

    @abstractmethod
    def config(self, args: Any, dtype: torch.dtype) -> dict:
        """(args, dtype) -> config.json contents."""

    def names(self, name: str, args: Any) -> list[str]:
        """The HF names of one of our tensors: several when it is several of theirs stacked on dim 0 (e.g. one
        weight for all experts, one per expert in HF)."""
        return [self.hf_name(name)]

    def join(self, key: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The HF tensor ``key`` made of several of ours ({our name: its ``to_hf`` tensor}), where ``names`` gives
        several of ours one name (e.g. gate and up interleaved in one tensor); ``from_hf`` takes each one's part."""
        raise AssertionError(f"{type(self).__name__} maps {', '.join(parts)} to one tensor {key}, unjoined")

    def unsupported(self, args: Any) -> str | None:
        """Why the HF class cannot hold a model built from ``args`` (refused at plan time), or None."""
        return None

    from_config: Callable[[dict, Any], dict] | None = None
    """(config.json, the flavor's args) -> our args as ``[model.overrides]`` keys plus ``tie_embeddings``; raises
    UserError naming the config.json key it cannot compute. A subclass sets it to a function (a static method);
    None: an imported folder's config.json is not read."""

    @property
    def reads_config(self) -> bool:
        return self.from_config is not None


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes autograd keeps from forward to backward, per token of one microbatch on one rank."""

    blocks: tuple[float, ...]
    """Each block (in order), without activation checkpointing."""
    block_input: float
    """What a checkpointed block keeps: its input."""
    pre: float
    """The modules before the blocks (first pipeline stage)."""
    post: float
    """The modules after the blocks and the loss (last pipeline stage)."""
    documents: float = 0.0
    """Under block-causal attention, what every pipeline stage keeps once for its blocks besides the mask
    (e.g. the rotary table gathered per token); the mask itself (seq_len values in the compute dtype per
    token) is counted by trainer/activation_memory.py."""


class ExpertLayer(ABC):
    """What expert parallelism (trainer.parallel.ep) needs of a family's mixture-of-experts layer: subclass it
    next to nn.Module. ``experts`` holds the stacked expert weights (dim 0 = expert), which EP shards over the
    ep ranks; ``n_experts`` counts them; ``set_dispatch`` installs how the layer's (token, expert) pairs reach
    the experts (local by default, an all-to-all under EP)."""

    experts: nn.Module
    n_experts: int

    @abstractmethod
    def set_dispatch(self, dispatch: Callable) -> None:
        """Route through ``dispatch(tokens sorted by expert, tokens per expert, compute) -> outputs`` from now on."""


@dataclass(frozen=True)
class ModelLayout:
    """Where generic code (pipeline split and costs, automatic TP, FSDP units, stage shapes) finds things in
    a model built from one family's args, so that it never reads the family's args by field name."""

    blocks: str = "layers"
    """The container of repeated blocks (``ModelSpec.layers_attr``)."""
    pre: tuple[str, ...] = ()
    """Top-level modules before the blocks."""
    post: tuple[str, ...] = ()
    """Top-level modules after the blocks."""
    dim: int | None = None
    """Hidden size: the width of the activations passed between blocks (None: unknown)."""
    vocab_size: int | None = None


def _size_rotary_table(args: Any, seq_len: int) -> Any:
    """Default ``with_seq_len``: families whose args have ``max_seq_len`` get it set to seq_len."""
    if any(f.name == "max_seq_len" for f in dataclasses.fields(args)):
        return dataclasses.replace(args, max_seq_len=seq_len)
    return args


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family."""

    name: str
    model_cls: type[nn.Module]
    """Called as ``model_cls(args)``; holds its repeated blocks in a container ``layers_attr`` (ModuleDict,
    Sequential or ModuleList)."""
    flavors: dict[str, Any]
    """Preset name -> frozen args dataclass instance."""
    flops_per_token: Callable[[Any, int], float]
    """(args, seq_len) -> training FLOPs per token (forward + backward)."""
    build_tp_plan: Callable[..., dict] | None = None
    """Returns {module name: ParallelStyle} for one block and for the top level; None = no TP."""
    layers_attr: str = "layers"
    """Name of the container of repeated blocks; pipeline stages are split between its entries."""
    manual_split: bool = True
    """Whether the manual pipeline front-end can cut this family: its forward runs with ``pre_layers`` and
    ``post_layers`` set to None and entries of a ModuleDict ``layers_attr`` deleted. False: pipelining
    needs ``pipeline_parallel_frontend = "tracer"``."""
    pre_layers: tuple[str, ...] = ("tok_embeddings",)
    """Top-level modules that run before the blocks (kept by the first pipeline stage)."""
    post_layers: tuple[str, ...] = ("norm", "output")
    """Top-level modules that run after the blocks (kept by the last pipeline stage)."""
    hf: HFAdapter | None = None
    """Hugging Face safetensors export/import; None = not supported for this family."""
    tied_weights: dict[str, str] = field(default_factory=dict)
    """With tied embeddings: {alias: canonical} parameter names that are one weight (pipeline
    stages hold one copy each, initialised under the canonical name)."""
    with_seq_len: Callable[[Any, int], Any] = _size_rotary_table
    """(args, seq_len) -> the args to build for training sequences of seq_len (e.g. rotary table length)."""
    vocab_size: Callable[[Any], int] = lambda args: args.vocab_size
    """args -> vocabulary size (the tokenizer is cut to it)."""
    hidden_dim: Callable[[Any], int | None] = lambda args: getattr(args, "dim", None)
    """args -> the width of the activations between blocks (pipeline transfers, attention FLOPs, stage
    shapes); the default reads a ``dim`` field, None when there is none."""
    tp_divisible: Callable[[Any], dict[str, int]] = lambda args: {}
    """args -> {name: count} that the tensor-parallel degree must divide (e.g. attention heads)."""
    validate_args: Callable[[Any], None] | None = None
    """Raise ConfigError (naming the ``[model.overrides]`` key) when resolved args cannot build a model."""
    auto_tp: bool = True
    """Whether ``tensor_parallel_plan = "auto"`` may derive a plan (False: the family's plan only)."""
    after_step: Callable[[nn.Module, Callable[[Any], Any]], dict[str, float]] | None = None
    """(chunk, sum over the batch's ranks) -> metrics: called on every chunk after each optimizer step
    (e.g. MoE load counts and balancing-bias updates). The metrics go to TensorBoard under the family's name."""
    idle_params: Callable[[Any], int] | None = None
    """args -> parameters a token does not use (the routed experts it is not sent to); the dry run prints the
    rest as the active parameters."""
    num_experts: Callable[[Any], int] | None = None
    """args -> routed experts per MoE layer; families with experts support expert parallelism."""
    activation_bytes: Callable[..., ActivationBytes | str] | None = None
    """(args, dtype_bytes=, tp=, sequence_parallel=, loss_parallel=) -> what autograd saves per token
    (trainer/activation_memory.py turns it into per-rank peaks for the dry run), or a string saying why
    these settings are not modelled; None = not estimated."""
    cp_buffers: tuple[str, ...] = ()
    """For a family without ``positions``: its buffers indexed by sequence position (e.g. a rotary table), which
    context parallelism re-indexes to each rank's tokens; such a family supports context parallelism under causal
    attention when its attention is a causal F.scaled_dot_product_attention."""
    job_limits: Callable[[Any, Any], str | None] = lambda args, dims: None
    """(args for the job's sequence length, ParallelDims) -> why a model built from these args cannot run this job
    (its sequence length, its parallel degrees), as one line naming the keys (the job is refused with it when
    planned), or None."""
    positions: bool = False
    """Whether the model's forward takes ``positions=``: (batch, seq) each token's position within its document
    (trainer.data.documents), by which it rotates its tokens and builds its mask with
    trainer.models.attention.block_causal_mask (``[model] attn_mask_type = "block_causal"``, context parallelism
    under either attention type); a pipeline chunk's forward takes it too."""

    def tied_aliases(self, args: Any) -> dict[str, str]:
        """{alias: canonical} of the weights tied in a model built from ``args`` (empty when untied)."""
        return self.tied_weights if getattr(args, "tie_embeddings", False) else {}

    def layout(self, args: Any) -> ModelLayout:
        """Where generic code finds the blocks, the pre/post modules and the sizes of a model of ``args``."""
        return ModelLayout(self.layers_attr, self.pre_layers, self.post_layers, self.hidden_dim(args),
                           self.vocab_size(args))

    def meta_model(self, args: Any) -> nn.Module:
        """The whole model on the meta device, without running its modules' default initialisers
        (meta tensors hold no values; the weights are drawn after allocation, by ``init_weights``)."""
        with _SkipMetaInit(), torch.device("meta"):
            return self.model_cls(args)


class _SkipMetaInit(TorchFunctionMode):
    """Turns in-place initialisers (``nn.init.*_``, ``Tensor.normal_``...) on meta tensors into no-ops.

    Several of them run through torch's Python reference kernels on the meta device, whose first
    call imports torch._dynamo (~0.5 s of start-up, measured); they would fill nothing anyway."""

    INITIALISERS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                              "xavier_uniform_", "xavier_normal_", "orthogonal_", "zeros_", "ones_", "constant_",
                              "zero_", "fill_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if getattr(func, "__name__", None) in self.INITIALISERS and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def model_blocks(model: nn.Module, layers_attr: str) -> dict[str, nn.Module]:
    """{key: block} of the repeated blocks, in order, whatever the container (also a traced stage's)."""
    return dict(getattr(model, layers_attr).named_children())


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a family; re-registering the same name replaces it (useful in notebooks)."""
    _REGISTRY[spec.name] = spec
    return spec


def import_model_modules(modules: list[str]) -> None:
    """Import the user modules named in ``[model] modules`` so they can register families."""
    for name in modules:
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
            raise ConfigError(f"[model] modules: {name!r} is not a Python module name"
                              " (like 'my_models' or 'pkg.models')")
        try:
            importlib.import_module(name)
        except Exception as e:  # a syntax error or an exception raised by the module itself included
            where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
            raise ConfigError(f"[model] modules: cannot import {name!r}: {type(e).__name__}: {e}{where}") from None


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"[model] name: unknown model family {name!r}{hint} (registered: {', '.join(sorted(_REGISTRY))};"
            " add your own with [model] modules)"
        )
    return _REGISTRY[name]


def resolve_model_args(spec: ModelSpec, model_section: Model) -> Any:
    """The flavor's args with ``[model] tie_embeddings`` and ``[model.overrides]`` applied."""
    if model_section.flavor not in spec.flavors:
        close = difflib.get_close_matches(model_section.flavor, list(spec.flavors), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"[model] flavor: {model_section.flavor!r} is not a flavor of {spec.name}{hint}"
            f" (flavors: {', '.join(spec.flavors)})"
        )
    args = spec.flavors[model_section.flavor]
    fields = {f.name: f for f in dataclasses.fields(args)}
    hints = typing.get_type_hints(type(args))
    updates = dict(model_section.overrides)
    if "attn_backend" in updates:  # a field set from [model], where the plan checks it
        raise ConfigError("[model.overrides] attn_backend: set [model] attn_backend instead (sdpa or varlen)")
    for key, value in updates.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"fields: {', '.join(fields)}"
            raise ConfigError(f"[model.overrides] {key}: not a field of {spec.name} args; {hint}")
        current = getattr(args, key)
        if value is None and type(None) in typing.get_args(hints.get(key)):  # unset an optional field (a window, ...)
            continue
        if current is not None and not _same_kind(current, value):
            raise ConfigError(
                f"[model.overrides] {key}: got {value!r}, expected a {type(current).__name__}"
                f" like the flavor's {current!r}"
            )
        if current is None and not _matches_annotation(hints.get(key), value):
            raise ConfigError(f"[model.overrides] {key}: got {value!r}, expected {_describe(hints.get(key))}")
        if isinstance(value, int) and not isinstance(value, bool) and _wants_float(current, hints.get(key)):
            try:
                updates[key] = float(value)  # 3 for a float field: the model computes with a float
            except OverflowError:
                raise ConfigError(f"[model.overrides] {key}: {value} is beyond the float range") from None
    if model_section.attn_backend != "sdpa":
        if "attn_backend" not in fields:
            raise ConfigError(f'[model] attn_backend = "{model_section.attn_backend}": model family {spec.name} has'
                              ' only the sdpa backend; set [model] attn_backend = "sdpa"')
        updates["attn_backend"] = model_section.attn_backend
    if model_section.tie_embeddings:
        if "tie_embeddings" not in fields:
            raise ConfigError(f"[model] tie_embeddings: model family {spec.name} does not support tied embeddings")
        updates["tie_embeddings"] = True
    resolved = dataclasses.replace(args, **updates)
    if spec.validate_args is not None:
        spec.validate_args(resolved)
    return resolved


def _matches_annotation(hint: Any, value: Any) -> bool:
    """Whether ``value`` fits a field declared ``hint`` (e.g. ``float | None``); unknown hints accept anything."""
    if hint is None:
        return True
    options = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    for option in options:
        if option is bool and isinstance(value, bool):
            return True
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option in (int, str) and isinstance(value, option) and not isinstance(value, bool):
            return True
        if not isinstance(option, type) or option not in (bool, int, float, str):
            return True  # a type this check does not know: the family's validate_args decides
    return False


def _describe(hint: Any) -> str:
    options = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
    return " or ".join(getattr(o, "__name__", str(o)) for o in options)


def _wants_float(current: Any, hint: Any) -> bool:
    if current is not None:
        return isinstance(current, float)
    return float in typing.get_args(hint) or hint is float


def _same_kind(current: Any, value: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))
