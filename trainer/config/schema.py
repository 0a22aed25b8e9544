"""The job schema: one frozen, keyword-only dataclass per TOML section.

The string literal under each field is its documentation: ``--help``, the generated
reference in ``docs/config_reference.md`` and error messages all read it from here.
``Annotated[..., Range(...)]`` declares the accepted range of a number.
"""

from dataclasses import dataclass, field
from typing import Annotated, Literal

from trainer.config.schedules import ScheduleName


def _number(value: float) -> str:
    """A bound as written: whole numbers in full (10^9 reads 1,000,000,000), others as %g."""
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 2**63 else f"{value:g}"


@dataclass(frozen=True)
class Range:
    """Accepted numeric range of a field; ``also`` lists extra accepted sentinel values."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple = ()

    def accepts(self, value: float) -> bool:
        if value in self.also:
            return True
        if self.ge is not None and value < self.ge:
            return False
        if self.gt is not None and value <= self.gt:
            return False
        if self.lt is not None and value >= self.lt:
            return False
        return self.le is None or value <= self.le

    def describe(self) -> str:
        parts = []
        if self.ge is not None:
            parts.append(f">= {_number(self.ge)}")
        if self.gt is not None:
            parts.append(f"> {_number(self.gt)}")
        if self.le is not None:
            parts.append(f"<= {_number(self.le)}")
        if self.lt is not None:
            parts.append(f"< {_number(self.lt)}")
        text = " and ".join(parts)
        for v in self.also:
            text += f" or {v}"
        return text


@dataclass(frozen=True)
class TableEntries:
    """A table key whose entries may themselves be small tables of single values (e.g. {weight = 3, split =
    "train"})."""


# Ceilings: far above any real job, low enough that a typo (10^20 steps) is one clear error instead of an overflow.
MAX_COUNT = 10**9  # steps, intervals, frequencies
MAX_BATCH = 2**24  # sequences in a batch (a global batch of 2^24 windows is still indexable in memory)
Positive = Range(gt=0)
NonNegative = Range(ge=0)
Rate = Range(ge=1e-3, le=1e7, also=(0,))  # a device's speed: 0 (not given) or a real one (the pricing divides by it)
Count = Range(gt=0, le=MAX_COUNT)
Degree = Range(ge=1, le=2**20)
Timeout = Range(gt=0, le=7 * 24 * 3600)  # a week; larger values overflow the process group's int timers


@dataclass(frozen=True, kw_only=True)
class Job:
    config_file: str = ""
    """TOML job file this config was loaded from (set with --job.config_file or CONFIG_FILE)."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, TensorBoard events, checkpoints."""
    description: str = "debug model on the bundled Python documentation"
    """Free-text description of the job, printed at start-up."""


@dataclass(frozen=True, kw_only=True)
class Model:
    name: str = "llama3"
    """Model family, as registered in trainer.models (built-in: llama3, moe)."""
    flavor: str = "debugmodel"
    """Size preset of the family (llama3: debugmodel, 270M, 1B, 3B, 8B, 70B, 405B)."""
    tokenizer_path: str = ""
    """tiktoken BPE file (e.g. Llama 3's tokenizer.model) or Hugging Face tokenizer.json; empty = bundled
    cl100k_base."""
    tokenizer_vocab_size: Annotated[int, Range(ge=0, le=2**31 - 1)] = 0
    """Keep only the first N BPE ranks of the tokenizer file; 0 = as many as the model vocab holds."""
    tie_embeddings: bool = False
    """Share one weight between the input embedding and the output projection."""
    attn_mask_type: Literal["auto", "causal", "block_causal"] = "auto"
    """block_causal: a token attends only to earlier tokens of its own document (documents end at the end-of-text token)
    and rotary positions restart at each document; causal: to every earlier token of the window. auto: block_causal
    where the model family takes document positions (every built-in family), else causal (said once)."""
    attn_backend: Literal["sdpa", "varlen"] = "sdpa"
    """Attention kernel. sdpa: F.scaled_dot_product_attention, with an additive mask when a window holds several
    documents (every device). varlen: each document of a window attended alone by the causal kernel, no mask
    (block_causal on CPU only; faster there, most at long sequences: docs/performance.md)."""
    modules: list[str] = field(default_factory=list)
    """Python modules to import before the model is looked up (to register your own families)."""
    overrides: dict = field(default_factory=dict)
    """Flavor fields to override, e.g. {n_layers = 4, dim = 128}; names are checked against the family."""


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""
    lr: Annotated[float, NonNegative] = 8e-4
    """Peak learning rate."""
    beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    """Adam beta1 (first-moment decay)."""
    beta2: Annotated[float, Range(ge=0, lt=1)] = 0.95
    """Adam beta2 (second-moment decay)."""
    eps: Annotated[float, Positive] = 1e-8
    """Adam epsilon."""
    weight_decay: Annotated[float, NonNegative] = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not norms)."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel: for-loop (reference), foreach (multi-tensor) or fused (one kernel per parameter group;
    CPU and CUDA, ~6x faster than foreach for the debug model on CPU)."""


@dataclass(frozen=True, kw_only=True)
class LRScheduler:
    warmup_steps: Annotated[int, Range(ge=0, le=MAX_COUNT)] = 2
    """Steps of linear warm-up from lr/warmup_steps to lr."""
    decay_ratio: Annotated[float, Range(ge=0, le=1)] | None = None
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); unset = decay right after warm-up."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay from lr to lr * min_lr_factor."""
    min_lr_factor: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Floor of the decay, as a fraction of lr."""


@dataclass(frozen=True, kw_only=True)
class DataLoader:
    text_column: str = "text"
    """Column of the dataset that holds the document text."""
    split: str = "train"
    """Dataset split to read (hub datasets and local files)."""
    subset: str = ""
    """Hugging Face dataset configuration name (e.g. 'en' for allenai/c4); empty = none."""
    streaming: bool = True
    """Stream hub datasets instead of downloading and preparing them (streamed text is tokenized by every rank; see
    docs/training.md)."""
    shuffle: bool = False
    """Shuffle the windows of each epoch (a keyed permutation of window indices; exact on resume); off = source
    order."""
    prefetch: bool = True
    """Read the next step's windows in a background thread while the current step runs."""
    cache_folder: str = "data_cache"
    """Where raw text (bundled, local files, downloaded hub data) is tokenized into shards before training, relative to
    the dump folder."""


@dataclass(frozen=True, kw_only=True)
class Training:
    dataset: str = "python_docs"
    """Dataset: 'python_docs' (bundled, offline) or a Hugging Face hub name; ignored when dataset_path is set."""
    dataset_path: str = ""
    """Prepared token shards (python -m trainer.prepare), or local .txt/.json/.jsonl/.parquet file(s); overrides
    dataset."""
    dataset_mix: Annotated[dict, TableEntries()] = field(default_factory=dict)
    """Several datasets with weights, e.g. {"data/web" = 3, "data/code" = {weight = 1, split = "train[:90%]"}}: keys as
    dataset_path (or a dataset name), weights > 0, each dataset's own split or else [training.dataloader] split;
    replaces dataset and dataset_path."""
    local_batch_size: Annotated[int, Positive] = 8
    """Sequences per forward/backward on one data-parallel rank."""
    global_batch_size: Annotated[int, Range(gt=0, le=MAX_BATCH, also=(-1,))] = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size * data-parallel degree (no accumulation)."""
    seq_len: Annotated[int, Positive] = 256
    """Tokens per training sequence."""
    max_norm: Annotated[float, NonNegative] = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping (the norm is still logged)."""
    steps: Annotated[int, Count] = 10
    """Optimizer steps to train for."""
    stop_at_step: Annotated[int, Count] | None = None
    """End this run after this step (saving a checkpoint if enabled) while the LR schedule still spans steps; for
    time-limited jobs."""
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype: auto = bfloat16 on accelerators, float32 on CPU."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of data-parallel gradient reduction."""
    gc_freq: Annotated[int, Count] = 50
    """Run Python's garbage collector every N steps (automatic collection is disabled)."""
    dataloader: DataLoader = field(default_factory=DataLoader)
    """Dataset reading options."""


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    data_parallel_replicate_degree: Annotated[int, Degree] = 1
    """Data-parallel replicas (DDP, or the replicate dim of HSDP)."""
    data_parallel_shard_degree: Annotated[int, Range(ge=1, le=2**20, also=(-1,))] = -1
    """FSDP shards per replica; -1 = all ranks left over by the other degrees."""
    tensor_parallel_degree: Annotated[int, Degree] = 1
    """Tensor-parallel ranks per model chunk."""
    tensor_parallel_plan: Literal["model", "auto"] = "model"
    """TP plan: the model family's hand-written one, or derived automatically from the block's structure."""
    tensor_parallel_overrides: dict = field(default_factory=dict)
    """With plan auto: per-module styles that replace the derived ones, e.g. {"mlp.c_fc" = "replicate"} (colwise,
    rowwise, replicate)."""
    enable_sequence_parallel: bool = True
    """With tensor parallelism, shard norms and residuals along the sequence (sequence parallel)."""
    disable_loss_parallel: bool = False
    """With tensor parallelism, gather the full-vocabulary logits instead of computing the loss on shards."""
    context_parallel_degree: Annotated[int, Degree] = 1
    """Context-parallel ranks (sequence split across ranks in attention)."""
    expert_parallel_degree: Annotated[int, Degree] = 1
    """Expert-parallel ranks, carved from the FSDP ranks (must divide data_parallel_shard_degree and the experts):
    each holds 1/ep of every MoE layer's experts, and tokens travel to their experts by all-to-all."""
    pipeline_parallel_degree: Annotated[int, Degree] = 1
    """Pipeline-parallel ranks."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Module names that start a new pipeline stage, e.g. ["layers.4"]; empty = generated."""
    pipeline_parallel_split_mode: Literal["makespan", "flops", "params", "even"] = "makespan"
    """Without split points: makespan = the split whose simulated step of the configured schedule is shortest (per-stage
    F/B/I/W costs, transfers, memory limit); flops / params = balance stages by FLOPs or parameters (embedding and
    output included); even = split layers evenly."""
    pipeline_parallel_cost_file: str = ""
    """Measured action durations (pipeline_costs.json, written by a run with [profiling] pipeline_timeline_steps) that
    the split planner and the dry run use instead of the FLOP model."""
    pipeline_parallel_device_tflops: Annotated[float, Rate] = 0.0
    """Achieved TFLOP/s of one device, to predict the pipeline step in seconds and weigh transfers; 0 = relative units,
    transfers not modelled."""
    pipeline_parallel_device_memory_gbytes_per_second: Annotated[float, Rate] = 0.0
    """Achieved memory bandwidth of one device in GB/s (with pipeline_parallel_device_tflops): the planner also prices
    the loss's passes over the logits and the embedding's dense gradient by their bytes; 0 = FLOPs only."""
    pipeline_parallel_link_gbytes_per_second: Annotated[float, Range(ge=1e-6, le=1e7)] = 25.0
    """Bandwidth between two pipeline ranks in GB/s, for the planner's transfer times."""
    pipeline_parallel_link_latency_us: Annotated[float, Range(ge=0, le=1e9)] = 20.0
    """Latency of one transfer between pipeline ranks in microseconds, for the planner."""
    pipeline_parallel_memory_limit_gib: Annotated[float, Range(ge=0, le=1e9)] = 0.0
    """Memory per device the planner's split must fit (state + activations of each rank, + the loss's gradient on the
    last stage's: the dry run's memory table), GiB; 0 = the device's memory
    at launch, no limit in a dry run."""
    pipeline_parallel_embedding_weight: Annotated[float, NonNegative] = 1.0
    """For split_mode even: the input embedding counts as this many layers on the first stage."""
    pipeline_parallel_output_weight: Annotated[float, NonNegative] = 1.0
    """For split_mode even: the final norm and output projection count as this many layers on the last stage."""
    pipeline_parallel_schedule: ScheduleName = "1F1B"
    """Pipeline schedule (torch.distributed.pipelining); zero-bubble ones split the backward into input and weight
    passes."""
    pipeline_parallel_schedule_csv: str = ""
    """CSV file defining a custom pipeline schedule; overrides pipeline_parallel_schedule."""
    pipeline_parallel_microbatch_size: Annotated[int, Range(gt=0, le=MAX_BATCH)] = 1
    """Sequences per pipeline microbatch."""
    pipeline_parallel_layers_per_stage: Annotated[int, Count] | None = None
    """Transformer layers per (virtual) stage; derives the number of stages per rank."""
    pipeline_parallel_frontend: Literal["manual", "tracer"] = "manual"
    """How stages are cut: manual = the model class with other stages' modules removed; tracer = torch's
    pipeline() traces the whole forward and splits the graph at the split points (any forward; FSDP/DDP only)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered FSDP parameters after forward: default = yes except for the last block."""


@dataclass(frozen=True, kw_only=True)
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    dataset: str = "python_docs"
    """Validation dataset, as [training] dataset; ignored when dataset_path is set."""
    dataset_path: str = ""
    """Prepared token shards or local text files to validate on, as [training] dataset_path."""
    split: str = "train"
    """Split (or slice, e.g. 'train[90%:]') of the validation dataset."""
    freq: Annotated[int, Count] = 500
    """Evaluate every N steps (and after the last step)."""
    steps: Annotated[int, Range(gt=0, le=MAX_COUNT, also=(-1,))] = -1
    """Global batches per evaluation (of the training batch shape); -1 = every whole batch of the validation set."""


# Parts of a checkpoint that [checkpoint] exclude_from_loading can name.
CHECKPOINT_PARTS = ("model", "optimizer", "dataloader", "train_state", "rng")


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from them."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to the dump folder."""
    interval: Annotated[int, Count] = 500
    """Save every N steps (and at the last step)."""
    keep_latest_k: Annotated[int, Range(ge=0, le=MAX_COUNT)] = 10
    """Keep only the newest K checkpoints; 0 = keep all."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Write checkpoints synchronously or in the background: the step waits only for the copy of the state to host
    memory. async_with_pinned_mem copies into page-locked host buffers allocated at the first save and reused by the
    later ones (CUDA; elsewhere it is async, with a warning)."""
    load_step: Annotated[int, Range(ge=0, le=MAX_COUNT, also=(-1,))] = -1
    """Resume from this step; -1 = the latest complete checkpoint."""
    initial_load_path: str = ""
    """Weights to start from when the run folder has no checkpoint: a DCP step folder or a Hugging Face safetensors
    folder."""
    verify: bool = True
    """Record every checkpoint file's size and sha256 at save (checksums.json, hashed in parallel by the ranks) and
    check them before loading."""
    fallback_on_damage: bool = True
    """When the checkpoint to resume from fails verification: move it aside to step-N.damaged and resume from the
    previous complete one, with a warning; false = stop with an error. An explicit load_step never falls back."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of the state not to load: model, optimizer, dataloader, train_state (step counter and LR schedule), rng; or
    'model.<name>': saved model tensors under <name> (e.g. model.layers.4) that this model lacks, left behind instead of
    refusing the checkpoint."""
    last_save_model_only: bool = True
    """At the last step, also write the weights alone (in export_dtype) to <folder>/model-step-N; the full, resumable
    step-N is saved too."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model-only final save and of the Hugging Face export."""
    export_hf: bool = False
    """At the last step, also write the weights as Hugging Face safetensors (+ index, config.json) to
    <folder>/hf-step-N."""


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, every block (full), or selective."""
    selective_ac_option: str = "2"
    """For selective: an integer N (checkpoint every N-th block) or 'op' (per-operator policy)."""


@dataclass(frozen=True, kw_only=True)
class Compile:
    enable: bool = False
    """Compile each transformer block with torch.compile."""


@dataclass(frozen=True, kw_only=True)
class Metrics:
    log_freq: Annotated[int, Count] = 1
    """Log metrics every N steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to the dump folder (each run writes into its own time-stamped subfolder)."""
    enable_wandb: bool = False
    """Also send the metrics to Weights & Biases (needs the wandb package; project, entity and mode from the WANDB_*
    environment variables, e.g. WANDB_MODE=offline); its files go into the run's folder under save_tb_folder."""
    peak_flops: Annotated[float, NonNegative] = 0.0
    """Peak FLOP/s of one device for MFU; 0 = look up known accelerators, or on CPU measure a float32 matmul at
    start."""


@dataclass(frozen=True, kw_only=True)
class Comm:
    init_timeout_seconds: Annotated[int, Timeout] = 300
    """Timeout for process-group set-up, the first collectives and the first training step (the watchdog ends a rank
    whose first step makes no progress for this long), in seconds."""
    train_timeout_seconds: Annotated[int, Timeout] = 100
    """Once training runs: timeout of every collective, and of the watchdog that ends a rank making no progress (no
    microbatch or pipeline step done) for this long, in seconds."""


@dataclass(frozen=True, kw_only=True)
class Debug:
    seed: Annotated[int, Range(ge=0, le=2**63 - 1)] = 0
    """Seed for weight init and any randomness in training."""
    deterministic: bool = False
    """Use deterministic algorithms only (slower; for reproducibility and parity tests)."""


@dataclass(frozen=True, kw_only=True)
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU and device kernels) of some steps, one Chrome trace per rank."""
    save_traces_folder: str = "profile_traces"
    """Folder for traces, relative to the dump folder."""
    profile_freq: Annotated[int, Count] = 10
    """With enable_profiling: profile the last profiler_active steps of every profile_freq steps."""
    profiler_warmup: Annotated[int, Range(ge=0, le=MAX_COUNT)] = 1
    """Steps the profiler runs untraced before its active steps (its start-up cost stays out of the trace)."""
    profiler_active: Annotated[int, Count] = 1
    """Steps traced in each profile_freq window."""
    enable_memory_snapshot: bool = False
    """On CUDA: record allocations and dump a memory snapshot every profile_freq steps (view at
    pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder for memory snapshots, relative to the dump folder."""
    activation_memory_steps: list[int] = field(default_factory=list)
    """Steps at which every rank measures what autograd keeps for backward (saved-tensor hooks, each storage once)
    and logs its peak next to the plan's estimate (the dry run's activations column). Costs a hook per saved tensor."""
    pipeline_timeline_steps: list[int] = field(default_factory=list)
    """Steps whose pipeline actions (F, B, I, W of each stage and microbatch) every rank times; merged into
    <save_traces_folder>/pipeline_timeline_step<N>.json (Chrome/Perfetto trace), with each pipeline rank's measured
    bubble logged. Pipelined jobs only."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    profiling: Profiling = field(default_factory=Profiling)
