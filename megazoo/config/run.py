"""Typed configuration of a training run: one dataclass per concern, validated on creation;
each documented field is a `pretrain_gpt.py` flag (`flags.py`). `PretrainArgs` bundles them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..parallel.config import ParallelConfig
from .compression import CompressionConfig
from .model import ModelConfig
from .offload import check_offload_fraction
from .zero import ZeroConfig

DECAY_STYLES = ("cosine", "linear", "constant")


@dataclass
class TrainingConfig:
    """Batches, iterations, optimizer, schedule and precision."""

    micro_batch_size: int = 8
    """Sequences per micro-batch on one data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all data-parallel ranks (accumulation fills it)."""
    train_iters: int = 800
    """Optimizer steps to train for."""
    lr: float = 3e-3
    """Peak learning rate (reached after the warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (0, as in Megatron: a run that sets only --lr
    decays to 0)."""
    lr_warmup_iters: int = 30
    """Steps of linear warmup from 0 to lr."""
    lr_decay_style: str = "cosine"
    """Decay after the warmup: "cosine", "linear" or "constant"."""
    lr_decay_iters: int | None = None
    """Step at which the decay reaches min_lr; None means train_iters."""
    weight_decay: float = 0.1
    """AdamW weight decay (never applied to biases and norms, the 1-D parameters)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    bf16: bool = False
    """bf16 parameters and compute (plain engine: fp32 main gradients, fp32 master weights
    and AdamW moments in the optimizer); without --bf16 / --fp16 everything is fp32."""
    fp16: bool = False
    """fp16 parameters and compute with dynamic loss scaling; fp32 masters as with --bf16."""
    fp32: bool = False
    """fp32 parameters and compute (also what you get without --bf16 / --fp16)."""
    initial_loss_scale: float = 2.0 ** 16
    """fp16: loss scale at the start."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the loss scale doubles."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never halves below this."""
    max_skipped_steps: int = 10
    """Stop the run after this many consecutive steps skipped for a non-finite loss or
    gradient norm (fp16 overflow included); 0: never stop."""
    use_distributed_optimizer: bool = False
    """Plain engine: shard fp32 masters and AdamW moments over dp x sp (reduce-scatter the
    gradients, all-gather the updated parameters)."""
    overlap_grad_reduce: bool = False
    """Plain engine: start each gradient bucket's reduction as soon as backward has
    produced all of it (under pipelines: the last micro-batch of each chunk)."""
    overlap_param_gather: bool = False
    """With --use-distributed-optimizer: all-gather the updated parameters asynchronously,
    each bucket waited for by the first module of the next forward that uses it."""
    tp_comm_overlap: bool = False
    """Model-parallel communication overlapped with the GEMMs beside it: tensor parallelism
    with --sequence-parallel fuses each all-gather + column-parallel GEMM and row-parallel
    GEMM + reduce-scatter, on GPUs through torch's symmetric-memory ops (copy-engine
    transfers, `megazoo.layers.symm_tp`), elsewhere in up to 4 chunks along the sequence
    (`megazoo.layers.tp_overlap`); Ulysses cuts its all-to-alls by kv groups inside the QKV
    and output projections (`megazoo.layers.ulysses_overlap`). Off: one collective per GEMM."""
    enable_cuda_graph: bool = False
    """Capture each transformer block's training forward and backward as CUDA graphs at the
    first micro-batch and replay them (`megazoo.training.block_graphs`): the host issues one
    launch per block where it issued hundreds, for layouts whose GPUs wait on the host
    (tensor and sequence parallelism); under a pipeline each chunk is captured once per
    micro-batch its schedule keeps in flight. The plain engine only."""
    ddp_bucket_size: int | None = None
    """Plain engine: elements per gradient bucket; None: max(40M, 1M x dp x sp) (Megatron's)."""
    gradient_accumulation_fusion: bool = True
    """Plain engine: the parallel linears' weight-gradient GEMMs add straight into the fp32
    main gradients (no per-micro-batch add pass; `megazoo.layers.wgrad`)."""
    accumulate_allreduce_grads_in_fp32: bool = True
    """Plain engine: fp32 main gradients, accumulated and reduced in fp32 (the default; for
    bf16 buffers pass --accumulate-grads-in-bf16 instead)."""
    accumulate_grads_in_bf16: bool = False
    """Plain engine: bf16 main gradients (half the GPU memory of fp32; each micro-batch's
    gradient is rounded to bf16 as it is summed; docs/offload.md gives the cost)."""
    optimizer_cpu_offload: bool = False
    """Plain engine: keep the fp32 masters and AdamW moments on the host (pinned memory, or
    on disk under --nvme-path) and step them there; bf16 parameters stay on the GPU."""
    optimizer_offload_host_memory: float | None = None
    """With --optimizer-cpu-offload --nvme-path: host memory (GB) the offloaded state may
    take; the buckets the forward uses first keep their state in memory while it fits, the
    rest go to disk. None: what the host has available at start, less 4 GB (and less the
    state a run that saves gathers), divided by the ranks on the host (docs/offload.md)."""
    optimizer_offload_fraction: float = 1.0
    """With --optimizer-cpu-offload: the share of the optimizer state (whole gradient
    buckets, the last ones the forward uses) kept and stepped on the host; the rest steps
    on the GPU."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With --optimizer-cpu-offload: copy each bucket's gradient to the host as soon as it is
    final, step the host buckets on a worker thread, and let the next forward wait for each
    bucket's updated parameters only when it reaches them."""
    offload_delayed_update: bool = False
    """With --overlap-cpu-optimizer-d2h-h2d: ZeRO-Offload's one-step delayed update; the host
    share's step t is computed while step t+1 runs and reaches the GPU before step t+2's
    forward (the GPU share steps at once). See docs/offload.md for its convergence."""
    offload_delayed_update_start: int = 0
    """With --offload-delayed-update: the first this many optimizer steps update at once,
    the delay starts after them (ZeRO-Offload's warm-up before its delayed update)."""
    seed: int = 1234
    """Seed of the weights, the data order and dropout."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Interleaved pipeline: layers per virtual stage (vpp = layers / pp / this)."""
    exit_interval: int | None = None
    """Stop (after saving, when --save is set) once the iteration divides by this."""
    cpu_threads: int | None = None
    """torch.set_num_threads on CPU; None keeps torch's default (one thread a core: on a
    shared machine fewer are faster, and the first log line says so)."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "micro_batch_size", "global_batch_size", "train_iters",
                  "ddp_bucket_size", "cpu_threads")
        _at_least(self, 0, "lr_warmup_iters", "max_skipped_steps", "clip_grad", "weight_decay",
                  "offload_delayed_update_start")
        if not 0 <= self.min_lr <= self.lr < math.inf:  # nan fails every comparison
            raise ValueError(f"need 0 <= --min-lr <= --lr, both finite, got --lr {self.lr} "
                             f"--min-lr {self.min_lr}")
        if self.offload_delayed_update_start and not self.offload_delayed_update:
            raise ValueError("--offload-delayed-update-start needs --offload-delayed-update: "
                             "add it or drop the start")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.bf16 + self.fp16 + self.fp32 > 1:
            raise ValueError("--bf16, --fp16 and --fp32 exclude each other: pass one of them")
        if not self.accumulate_allreduce_grads_in_fp32:
            raise ValueError("main gradients are always fp32 unless --accumulate-grads-in-bf16: "
                             "pass that instead of --no-accumulate-allreduce-grads-in-fp32")
        check_offload_fraction(self.optimizer_offload_fraction)
        if not 0 <= (self.optimizer_offload_host_memory or 0) < math.inf:
            raise ValueError(f"--optimizer-offload-host-memory must be a finite >= 0 GB, got "
                             f"{self.optimizer_offload_host_memory}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        if not 1.0 <= self.min_loss_scale <= self.initial_loss_scale or self.loss_scale_window < 1:
            raise ValueError("need 1 <= --min-loss-scale <= --initial-loss-scale and "
                             "--loss-scale-window >= 1")

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters or self.train_iters

    def bucket_elements(self, dp_sp: int) -> int:
        """Elements per gradient bucket: --ddp-bucket-size, else Megatron's
        max(40M, 1M x dp x sp)."""
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * dp_sp)


@dataclass
class DataConfig:
    """Where the tokens come from."""

    data_path: list[str] | None = None
    """Dataset prefixes (PREFIX.bin/.idx), or weight-prefix pairs "0.3 a 0.7 b" to blend;
    None: the default corpus (Python's standard library sources, prepared once)."""
    split: str = "969,30,1"
    """Train/valid/test proportions of the documents."""
    tokenizer_type: str | None = None
    """SentencePieceTokenizer, HFTokenizer or ByteLevelTokenizer (default run: SentencePiece)."""
    tokenizer_model: str | None = None
    """SentencePiece .model or HF tokenizer.json matching the data."""
    seq_length: int = 128
    """Tokens per training sequence."""
    data_cache_path: str = "data_cache"
    """Folder for the default corpus, its tokenizer and the dataset index files."""
    default_corpus_mb: float = 6.0
    """Default corpus: megabytes of standard-library source to use."""
    default_vocab_size: int = 2048
    """Default corpus: vocabulary of the SentencePiece BPE trained on it."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "seq_length")
        if self.data_path is None and (self.tokenizer_type or self.tokenizer_model):
            raise ValueError("--tokenizer-type/--tokenizer-model need --data-path: the default "
                             "corpus comes with its own tokenizer")
        if self.data_path is not None and self.tokenizer_type is None:
            raise ValueError("--data-path needs --tokenizer-type (and --tokenizer-model) "
                             "naming the tokenizer the data was made with")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = "checkpoints"
    """Folder of checkpoints (iter_0000100/ ... and `latest`); "" or None: do not save."""
    load: str | None = None
    """Resume from this folder's `latest` checkpoint (or from an iter_* folder)."""
    save_interval: int | None = None
    """Save every this many iterations (and at the end); None: only at the end."""
    verify_checksums: bool = True
    """Check every tensor read from --load against the checksum its megazoo.json recorded."""
    allow_nonfinite_load: bool = False
    """Load a checkpoint even if a tensor holds inf or nan (refused otherwise)."""
    overwrite_checkpoints: bool = False
    """Save over complete checkpoints in --save: another run's (other model shape or --seed),
    or iterations later than the one resumed from (`latest` pointed back); refused otherwise.
    Only the files the run writes are replaced: any other file there is named and refused."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "save_interval")


@dataclass
class LoggingConfig:
    """What is printed and recorded."""

    log_interval: int = 50
    """Log every this many iterations."""
    eval_interval: int = 200
    """Validation loss every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Global batches of validation data per evaluation."""
    log_json: str | None = None
    """Also write every log line as a JSON object to this file."""
    tensorboard_dir: str | None = None
    """TensorBoard event folder (needs the tensorboard package)."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project (needs the wandb package; offline without an API
    key or with WANDB_MODE=offline)."""
    wandb_exp_name: str | None = None
    """Weights & Biases run name (None: wandb picks one)."""
    wandb_save_dir: str | None = None
    """Weights & Biases files folder (None: SAVE/wandb, or ./wandb without --save)."""
    plot_curves: bool = True
    """At the end, draw the run's curves (loss, lr, tokens/s, ...) to SAVE/curves.png
    (needs matplotlib)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; None: measure a bf16 matmul once (GPU only)."""
    eval_only: bool = False
    """With --load: print the validation loss and exit."""
    generate_tokens: int = 80
    """Tokens of the sample generated at the end (0: none)."""
    prompt: str = "def"
    """Prompt of the sample generated at the end."""
    generate_top_k: int = 10
    """Sample among the k most likely tokens (1: greedy)."""
    progress: bool = True
    """Show a tqdm progress bar (rank 0, on a terminal; a redirected log gets log lines only)."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "log_interval", "eval_interval")
        _at_least(self, 0, "eval_iters", "generate_tokens")
        try:  # a shell passes bytes that are not UTF-8 as lone surrogates: refuse them now,
            self.prompt.encode("utf-8")  # not when the sample is drawn after training
        except UnicodeEncodeError:
            raise ValueError("--prompt is not valid UTF-8 text: pass the prompt as UTF-8") from None


@dataclass
class PretrainArgs:
    """Everything one `pretrain_gpt.py` run needs (what engines receive as `config`)."""

    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    model_name: str | None = None
    """The --model preset, if one was given."""

    def to_dict(self) -> dict:
        """Plain JSON-able dict (stored in checkpoints)."""
        return asdict(self)


def _at_least(config, minimum: int, *names: str) -> None:
    """ValueError naming the flag of the first field of `names` below `minimum` (None: unset)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
