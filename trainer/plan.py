"""The job plan: everything decided from (config, world size) before a process group exists.

``build_job_plan`` is the one place that turns a config into what will run: the parallel
degrees, the model's resolved args, the pipeline stages and their ranks, the tensor-parallel
plan, the batch arithmetic, the reporting rank, FLOPs and memory per device. Building it is
the validation: every user error is raised here, as one line naming the key. The dry run
prints it, ``main`` trains from it, ``run_train.sh``'s pre-check builds it, and nothing
recomputes what it holds.
"""

import dataclasses
import functools
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import JobConfig
from trainer.config.validate import check_batch
from trainer.dtypes import compute_dtype, torch_dtype
from trainer.env import device_memory_bytes, device_type
from trainer.errors import ConfigError
from trainer.models import ModelSpec, get_model_spec, import_model_modules, resolve_model_args
from trainer.models.registry import ModelLayout
from trainer.parallel.auto_tp import TPPlan
from trainer.parallel.dims import ParallelDims
from trainer.parallel.parallelize import check_techniques, resolve_tp_plan
from trainer.parallel.technique import ChunkSetup, PlanFacts
from trainer.pipeline.cost import (BYTES_PER_PARAM, PartCosts, SplitMemory, loss_gradient_bytes,
                                   part_flops, part_params, pipeline_costs, split_memory_limit, stage_sums)
from trainer.pipeline.simulate import bubble_fraction, lowered, schedule_ops
from trainer.pipeline.split import PipelinePlan, build_pipeline_plan

logger = logging.getLogger(__name__)
# byte tokens + trainer.data.tokenizer.NUM_SPECIAL (not imported: the launcher stays light)
MIN_TIKTOKEN_VOCAB = 256 + 2

# The dry run plans for the job's accelerators: mixed_precision_param "auto" means bf16.
DRY_RUN_DEVICE = "cuda"


@dataclass(frozen=True)
class JobPlan:
    config: JobConfig
    dims: ParallelDims
    spec: ModelSpec
    model_args: Any
    """The family's args with flavor, overrides, tied embeddings and seq_len applied."""
    num_params: int
    flops_per_token: float
    """Training FLOPs per token (forward + backward), from the family."""
    tp_plan: TPPlan | None
    pipeline: PipelinePlan | None
    accum_steps: int
    """Microbatches per optimizer step on one data-parallel rank (gradient accumulation)."""
    n_microbatches: int
    """Microbatches per pipeline schedule step (1 without pipelining)."""
    reporting_rank: int
    """The rank that logs metrics: data/tensor-parallel rank 0 of the pipeline rank holding the last stage."""
    stage_params: tuple[int, ...]
    """Parameters of each pipeline stage (one entry, the whole model, without pipelining)."""
    stage_flops: tuple[float, ...]
    """Forward FLOPs per token of each stage (matmuls and attention scores)."""

    def build_model(self) -> nn.Module:
        """The whole model on the meta device (a pipeline chunk removes what its stage does not own)."""
        return self.spec.meta_model(self.model_args)

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size(self.model_args)

    @property
    def traced(self) -> bool:
        """Whether pipeline stages come from torch's tracer (``pipeline_parallel_frontend = "tracer"``)."""
        return self.pipeline is not None and self.config.parallelism.pipeline_parallel_frontend == "tracer"

    @property
    def attn_mask_type(self) -> str:
        """``[model] attn_mask_type``, "auto" resolved for the family (``resolve_attention``)."""
        return self.config.model.attn_mask_type

    @property
    def positions_always(self) -> bool:
        """Whether every batch gives the model its tokens' positions, not only a batch whose windows cross a
        document boundary: under context parallelism (a rank holds parts of each sequence) and for traced stages
        under block-causal attention (the graph has the input)."""
        return self.spec.positions and (self.dims.cp > 1 or (self.traced and self.attn_mask_type == "block_causal"))

    # What the rank's build (trainer.model_parts) needs from the config, so that it never reads the config.
    @property
    def seed(self) -> int:
        return self.config.debug.seed

    @property
    def seq_len(self) -> int:
        return self.config.training.seq_len

    @property
    def microbatch_size(self) -> int:
        """Sequences per pipeline microbatch (``pipeline_parallel_microbatch_size``)."""
        return self.config.parallelism.pipeline_parallel_microbatch_size

    @property
    def schedule_csv(self) -> str:
        return self.config.parallelism.pipeline_parallel_schedule_csv

    def chunk_setup(self, meshes, device: torch.device) -> ChunkSetup:
        """What this rank's techniques are built from: their own config sections and the plan's derived values."""
        c = self.config
        return ChunkSetup(meshes=meshes, spec=self.spec, layout=self.layout, parallelism=c.parallelism,
                          activation_checkpoint=c.activation_checkpoint, tp_plan=self.tp_plan, seq_len=self.seq_len,
                          param_dtype=self.compute_dtype(device),
                          reduce_dtype=torch_dtype(c.training.mixed_precision_reduce),
                          compile_enabled=c.compile.enable, pipelined=self.pipeline is not None)

    def activation_peaks(self, device_type: str) -> list[float] | str:
        """Estimated peak bytes of saved activations on each pipeline rank when the job runs on ``device_type``
        devices (the compute dtype follows ``[training] mixed_precision_param``), or why there is no estimate
        (trainer.activation_memory)."""
        from trainer.activation_memory import activation_sections, part_activations, rank_actions, rank_peaks

        per_part = part_activations(self.spec, self.model_args, self.dims,
                                    self.compute_dtype(torch.device(device_type)).itemsize,
                                    **activation_sections(self.config))
        if isinstance(per_part, str):
            return per_part
        pipeline = self.pipeline
        if pipeline is None:
            tokens = self.config.training.local_batch_size * self.seq_len
            return [tokens * (sum(per_part.kept) + per_part.stage + max(per_part.recompute))]
        if pipeline.traits.from_file:
            return "not modelled for CSV schedules"
        ops = schedule_ops(pipeline.schedule, pipeline.pp, self.n_microbatches, pipeline.stages_per_rank)
        return rank_peaks(per_part, pipeline.counts, rank_actions(lowered(ops)[0]), self.microbatch_size * self.seq_len)

    def loss_gradient_bytes(self) -> float:
        """What the loss's backward allocates beside the kept activations, on the rank that computes the loss, at
        the start of each microbatch's backward: the float32 gradients of nll_loss and of log_softmax over every
        logit of the microbatch, alive together (8 bytes a logit; the vocabulary split under loss parallelism)."""
        sequences = self.config.training.local_batch_size if self.pipeline is None else self.microbatch_size
        return loss_gradient_bytes(self.config, self.spec, self.model_args, self.dims, sequences)

    def loss_rank(self) -> int:
        """The pipeline rank that computes the loss (the last stage's)."""
        return 0 if self.pipeline is None else self.pipeline.rank_of_stage(self.pipeline.num_stages - 1)

    @cached_property
    def layout(self) -> ModelLayout:
        return self.spec.layout(self.model_args)

    @property
    def tied_aliases(self) -> dict[str, str]:
        return self.spec.tied_aliases(self.model_args)

    @property
    def global_batch_size(self) -> int:
        return self.config.training.local_batch_size * self.dims.dp * self.accum_steps

    @property
    def global_batch_parts(self) -> str:
        """How the global batch is made up, for messages: ``local 4 x data-parallel 2 x accumulation 1``."""
        return (f"local {self.config.training.local_batch_size} x data-parallel {self.dims.dp}"
                f" x accumulation {self.accum_steps}")

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return compute_dtype(self.config.training.mixed_precision_param, device.type)

    def check_traced_dtype(self, device: torch.device) -> None:
        """Traced stages run in float32 only: torch sizes their receive buffers from the trace's dtypes
        (float32), which bf16/fp16 activations between stages would not match (untested on GPUs, refused)."""
        if self.traced and self.compute_dtype(device) != torch.float32:
            raise ConfigError(
                f"[training] mixed_precision_param = {self.config.training.mixed_precision_param!r} gives"
                f" {str(self.compute_dtype(device)).removeprefix('torch.')} compute on {device.type}, but"
                " pipeline_parallel_frontend = \"tracer\" runs in float32 only; set mixed_precision_param ="
                " \"float32\" or use the manual front-end")

    def rank_params(self, pp_rank: int) -> int:
        """Parameters held by pipeline rank ``pp_rank`` (all of them without pipelining)."""
        if self.pipeline is None:
            return self.num_params
        return sum(self.stage_params[s] for s in self.pipeline.stage_ids(pp_rank))

    @property
    def param_split(self) -> int:
        """Ways each parameter is split in memory: FSDP over dp_shard x cp, times TP."""
        return self.dims.dp_shard * self.dims.cp * self.dims.tp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of each sequence a rank holds (the whole sequence unless context parallel)."""
        return self.config.training.seq_len // self.dims.cp

    def state_gib_per_device(self, pp_rank: int) -> float:
        """fp32 parameters, gradients and Adam moments per device, split by FSDP x TP (no activations)."""
        return self.rank_params(pp_rank) * BYTES_PER_PARAM / self.param_split / 2**30

    @cached_property
    def pipeline_costs(self) -> PartCosts | None:
        """Per-part action costs of the pipeline planner (None without pipelining), on the job's accelerators."""
        if self.pipeline is None:
            return None
        return pipeline_costs(self.config, self.spec, self.model_args, self.build_model(), self.dims, DRY_RUN_DEVICE)

    def bubble(self) -> float | None:
        """Expected idle fraction of the pipeline ranks (None: no pipeline, or a CSV schedule)."""
        p = self.pipeline
        if p is None or p.traits.from_file:
            return None
        return bubble_fraction(p.schedule, p.pp, self.n_microbatches, p.stages_per_rank)


def _check_varlen(config: JobConfig, device: str | None) -> None:
    """The varlen backend attends document by document with lengths read on the host: block-causal attention,
    eager blocks (a compiled block would recompile for every new set of lengths), and a CPU job (on an
    accelerator, reading the lengths would wait for the device). ``device``: None in a dry run."""
    key = '[model] attn_backend = "varlen"'
    if config.model.attn_mask_type != "block_causal":
        raise ConfigError(f'{key} attends each document alone: it needs [model] attn_mask_type = "block_causal"'
                          ' (or attn_backend = "sdpa")')
    if config.compile.enable:
        raise ConfigError(f"{key} with [compile] enable: a compiled block would recompile for every new set of"
                          ' document lengths; use attn_backend = "sdpa"')
    if device not in (None, "cpu"):
        raise ConfigError(f"{key} on {device}: it reads each window's document lengths on the host, which would"
                          ' wait for the device; use attn_backend = "sdpa"')


def resolve_attention(config: JobConfig, spec: ModelSpec) -> JobConfig:
    """``[model] attn_mask_type = "auto"`` made concrete: block_causal where the family takes document positions,
    else causal, said once. An explicit block_causal for a family without positions is refused."""
    model = config.model
    if model.attn_mask_type == "block_causal" and not spec.positions:
        raise ConfigError(f'[model] attn_mask_type = "block_causal": model family {spec.name} does not take document'
                          ' positions (ModelSpec.positions); set [model] attn_mask_type = "causal" (or "auto")')
    if model.attn_mask_type != "auto":
        return config
    if not spec.positions:
        logger.warning("[model] attn_mask_type = \"auto\": model family %s does not take document positions"
                       " (ModelSpec.positions), so it attends causally across the documents packed into a window"
                       " (a token sees the end of the previous document); set attn_mask_type = \"causal\" to say"
                       " so", spec.name)
    resolved = "block_causal" if spec.positions else "causal"
    return dataclasses.replace(config, model=dataclasses.replace(model, attn_mask_type=resolved))


MAX_MICROBATCHES = 10_000  # far above any real schedule; planning 10^6 took over a minute


def build_job_plan(config: JobConfig, world_size: int, *, check_memory: bool = True, world_name: str = "") -> JobPlan:
    """Decide and check everything about the job that needs no process group. Raises ConfigError.

    ``check_memory``: refuse a job whose lower-bound memory per device exceeds this machine's
    devices (off for the dry run, which plans for other machines)."""
    t, p = config.training, config.parallelism
    import_model_modules(config.model.modules)
    spec = get_model_spec(config.model.name)
    config = resolve_attention(adopt_imported_model(config, spec), spec)
    args = spec.with_seq_len(resolve_model_args(spec, config.model), t.seq_len)
    dims = ParallelDims.from_config(p, world_size, world_name)
    check_batch(t, dims.dp)
    if config.checkpoint.export_hf and spec.hf is None:
        raise ConfigError(
            f"[checkpoint] export_hf: model family {spec.name} has no Hugging Face adapter (ModelSpec.hf);"
            " set export_hf = false"
        )
    if config.checkpoint.export_hf and (why := spec.hf.unsupported(args)):
        raise ConfigError(f"[checkpoint] export_hf: the Hugging Face class of {spec.name} cannot hold this model:"
                          f" {why}")
    vocab = spec.vocab_size(args)
    if not config.model.tokenizer_path.endswith(".json") and vocab < MIN_TIKTOKEN_VOCAB:
        raise ConfigError(f"[model.overrides] vocab_size={vocab}: a tiktoken tokenizer needs the 256 byte tokens and"
                          f" 2 special ones, so vocab_size >= {MIN_TIKTOKEN_VOCAB}")
    if check_memory:  # before the model is built: absurd sequence lengths overflow even meta tensors
        _check_logits_memory(config, dims, spec.vocab_size(args))
    whole = spec.meta_model(args)  # the plan's one model build: sizes, costs, split, TP plan
    check_techniques(PlanFacts(dims, spec, args, whole, p, config.model, config.compile.enable))
    if why := spec.job_limits(args, dims):
        raise ConfigError(why)
    if config.model.attn_backend == "varlen":
        _check_varlen(config, device_type() if check_memory else None)
    num_params = sum(x.numel() for x in whole.parameters())
    # Unshardable sizes fail here (a derived plan runs one meta forward), not after launch.
    layout = spec.layout(args)
    tp_plan = resolve_tp_plan(spec, layout, whole, p, seq_len=t.seq_len)
    pipeline, n_micro = None, 1
    if dims.pp > 1:
        n_micro = t.local_batch_size // p.pipeline_parallel_microbatch_size
        if n_micro > MAX_MICROBATCHES:  # the schedule's action lists (and their replay) grow with the count
            raise ConfigError(f"[training] local_batch_size={t.local_batch_size} / [parallelism]"
                              f" pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size}: {n_micro:,}"
                              f" microbatches per step, more than {MAX_MICROBATCHES:,}; use larger microbatches")
        device = device_type() if check_memory else DRY_RUN_DEVICE
        limit = split_memory_limit(p, check_memory)
        memory = SplitMemory(config, spec, args, whole, dims, device, n_micro, limit)
        pipeline = build_pipeline_plan(p, whole, layout, seq_len=t.seq_len, n_microbatches=n_micro,
                                       costs=functools.partial(pipeline_costs, config, spec, args, whole, dims, device),
                                       fits=None if limit is None else memory.fits)
    # Parameters and forward FLOPs/token per stage (a tied weight counts on the first and last stages: each holds it)
    flops = [mm + attn for mm, attn in part_flops(whole, layout, seq_len=t.seq_len)]
    counts = (len(flops) - 2,) if pipeline is None else pipeline.counts
    stage_params = (num_params,) if pipeline is None else tuple(round(x) for x in stage_sums(part_params(whole, layout),
                                                                                             counts))
    stage_flops = tuple(stage_sums(flops, counts))
    plan = JobPlan(
        config=config, dims=dims, spec=spec, model_args=args, num_params=num_params,
        flops_per_token=spec.flops_per_token(args, t.seq_len), tp_plan=tp_plan, pipeline=pipeline,
        accum_steps=1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dims.dp),
        n_microbatches=n_micro, reporting_rank=_reporting_rank(dims, pipeline),
        stage_params=stage_params, stage_flops=stage_flops,
    )
    if check_memory:
        _check_state_memory(plan)
    if pipeline is not None and pipeline.search is None and p.pipeline_parallel_memory_limit_gib:
        # a split the user gave (or an even/FLOP-balanced one) is not searched: its ranks are still held to the limit
        rank_bytes = memory.rank_bytes(pipeline.counts, [pipeline.stage_ids(r) for r in range(dims.pp)])
        if max(rank_bytes) > limit:
            worst = max(range(dims.pp), key=lambda r: rank_bytes[r])
            logger.warning("[parallelism] pipeline_parallel_memory_limit_gib = %g: the split %s puts %.2f GiB on pp"
                           " rank %d (state + activations + the loss's gradient), above the limit; the split mode"
                           " 'makespan' without split points would search splits within it",
                           p.pipeline_parallel_memory_limit_gib, pipeline.split_points(), rank_bytes[worst] / 2**30,
                           worst)
    if pipeline is not None and pipeline.search is not None and pipeline.search.refused_for_memory:
        logger.warning("[parallelism] pipeline split %s chosen without %d splits in which a rank would exceed the"
                       " memory limit of %.1f GiB (pipeline_parallel_memory_limit_gib, 0 = this device's memory)",
                       pipeline.split_points(), pipeline.search.refused_for_memory, limit / 2**30)
    if pipeline is not None and n_micro < pipeline.num_stages:
        bubble = plan.bubble()
        logger.warning(
            "[parallelism] %d microbatches for %d stages: the pipeline never fills (expected bubble %s);"
            " raise [training] local_batch_size or lower pipeline_parallel_microbatch_size",
            n_micro, pipeline.num_stages, "unknown" if bubble is None else f"{100 * bubble:.0f}%",
        )
    return plan


def adopt_imported_model(config: JobConfig, spec: ModelSpec) -> JobConfig:
    """The config with ``[model]`` taken from config.json when the run starts from a Hugging Face folder
    (trainer.hf.adopt_hf_config); otherwise unchanged."""
    source = config.checkpoint.initial_load_path
    if source:
        from trainer.hub import hub_folder, is_hub_id

        if is_hub_id(source):  # the Hub's copy, in the Hugging Face cache; the run reads it from the folder
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(
                config.checkpoint, initial_load_path=str(hub_folder(source, "[checkpoint] initial_load_path"))))
    folder = Path(config.checkpoint.initial_load_path) if config.checkpoint.initial_load_path else None
    if folder is None or not (folder / "config.json").is_file() or spec.hf is None or not spec.hf.reads_config:
        return config
    from trainer.hf import adopt_hf_config  # only here: the launcher's check stays light otherwise

    return dataclasses.replace(config, model=adopt_hf_config(folder, spec, config.model))


def degrees_product(config: JobConfig) -> int:
    """World size implied by the degrees when none is given (data_parallel_shard_degree -1 counts as 1)."""
    p = config.parallelism
    return (p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1) * p.context_parallel_degree
            * p.tensor_parallel_degree * p.pipeline_parallel_degree)


def _check_state_memory(plan: JobPlan) -> None:
    """Refuse what cannot fit before anything is allocated: fp32 parameters + gradients + Adam
    moments of the busiest pipeline rank, exact arithmetic on the config (a lower bound)."""
    available, gib = device_memory_bytes(), 2**30
    state = max(plan.state_gib_per_device(r) for r in range(plan.dims.pp)) * gib
    if state > available:
        raise ConfigError(
            f"[model] {plan.config.model.flavor} with [model.overrides] {plan.config.model.overrides or '{}'}:"
            f" {plan.num_params / 1e9:,.2f}B parameters need ~{state / gib:,.0f} GiB per device for weights,"
            f" gradients and Adam state (split {plan.param_split} ways), more than the {available / gib:,.0f} GiB"
            " of this machine's device; raise [parallelism] data_parallel_shard_degree or tensor_parallel_degree"
        )


def _check_logits_memory(config: JobConfig, dims: ParallelDims, vocab_size: int) -> None:
    """The fp32 logits of one microbatch (batch x tokens per rank x vocabulary / TP) are a lower
    bound of the activation memory of any language model."""
    t, available, gib = config.training, device_memory_bytes(), 2**30
    batch = t.local_batch_size if dims.pp == 1 else config.parallelism.pipeline_parallel_microbatch_size
    logits = batch * (t.seq_len // dims.cp) * vocab_size * 4 / dims.tp
    if logits > available:
        raise ConfigError(
            f"[training] local_batch_size={t.local_batch_size}, seq_len={t.seq_len}: the logits of one microbatch"
            f" alone need ~{logits / gib:,.0f} GiB (x vocabulary {vocab_size}), more than the"
            f" {available / gib:,.0f} GiB of this machine's device"
        )


def _reporting_rank(dims: ParallelDims, pipeline: PipelinePlan | None) -> int:
    if pipeline is None:
        return 0
    last_pp_rank = pipeline.rank_of_stage(pipeline.num_stages - 1)
    return last_pp_rank * (dims.world_size // dims.pp)  # pp is the outermost mesh dim
