"""What the planner reads from a run's configuration, resolved once.

The planner takes the run's own `PretrainArgs` (`megazoo.config.run`): the model, the
parallel layout (`parallel.dp` is the data-parallel size to plan for; None means 1), the
micro-batch and global batch, the sequence length, recompute and the ZeRO flags. `resolve`
checks them with the run's own `check_args` and turns them into the few numbers the
formulas use (`Resolved`): ZeRO flags left to a DeepSpeed JSON are read through the run's
`build_ds_config`, FSDP2 is ZeRO-3 and offloads all or nothing, and the micro-batches per
step follow from the global batch. `PlanOptions` holds what only the planner needs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.ds_config import build_ds_config, offload_device, zero_stage
from ..config.run import PretrainArgs
from ..config.validate import check_args
from ..config.zero import ZeroConfig


def corpus_vocab(args: PretrainArgs) -> int | None:
    """The vocabulary a run without --data-path or a --model preset trains with: the default
    corpus's tokenizer has --default-vocab-size tokens, and the run sizes its embedding and
    head by it (`training.data.build_data`), whatever the model config says; None otherwise
    (the run's tokenizer decides; the planner keeps the model config's)."""
    if args.data.data_path is None and args.model_name is None:
        return args.data.default_vocab_size
    return None


@dataclass(frozen=True)
class PlanOptions:
    """What the planner needs besides the run's flags."""

    gpu_memory: float = 80.0
    """Memory of one GPU, in GB (1e9 bytes), for the verdict."""
    gpus_per_node: int = 8
    """GPUs sharing one host, for the host-memory total per node."""
    fp32_grad_accumulation: bool = False
    """Plan DeepSpeed's gradients accumulated in fp32 (4 B per parameter) instead of bf16 (2 B)."""
    host_memory: float = 0.0
    """Host memory of one node, in GB, for the verdict (0: not checked)."""
    disk_memory: float = 0.0
    """Free disk under --nvme-path on one node, in GB, for the verdict (0: not checked)."""

    def __post_init__(self) -> None:
        if self.gpu_memory <= 0 or self.gpus_per_node < 1:
            raise ValueError(f"--gpu-memory must be > 0 and --gpus-per-node >= 1, got "
                             f"{self.gpu_memory} and {self.gpus_per_node}")
        if self.host_memory < 0 or self.disk_memory < 0:
            raise ValueError(f"--host-memory and --disk-memory must be >= 0 GB, got "
                             f"{self.host_memory} and {self.disk_memory}")


@dataclass(frozen=True)
class OptimizerOffload:
    """The optimizer state's offload, one record for every engine: DeepSpeed's
    `offload_optimizer` (its ratio), FSDP2's CPUOffloadPolicy, the plain engine's
    --optimizer-cpu-offload (--optimizer-offload-fraction, its disk tier)."""

    device: str = "none"
    """"none" or "cpu" (the planner models host offload only)."""
    ratio: float = 1.0
    """Share of the masters and moments on the host."""
    disk: bool = False
    """Plain engine with --nvme-path: the host share spills to disk (`offload.host_split`)."""
    host_memory: float | None = None
    """Plain engine with the disk tier: --optimizer-offload-host-memory (GB), or None."""
    overlap: bool = False
    """Plain engine with --overlap-cpu-optimizer-d2h-h2d: the host steps beside the GPU."""
    delayed: bool = False
    """Plain engine with --offload-delayed-update: the host step runs through the next step."""

    @property
    def on(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class Resolved:
    """The numbers the formulas use (derived from PretrainArgs + PlanOptions by `resolve`)."""

    tp: int
    sp: int
    pp: int
    vpp: int
    dp: int
    micro_batch_size: int
    seq_length: int
    num_micro_batches: int
    megatron_sp: bool
    recompute: str
    zero_impl: str
    zero_stage: int
    optimizer_offload: OptimizerOffload
    offload_param: str
    fsdp_reshard_after_forward: bool
    options: PlanOptions
    low_precision: bool = True
    """bf16 / fp16 parameters and compute (else fp32: --fp32 or no precision flag)."""
    distributed_optimizer: bool = False
    """Plain engine: masters and moments sharded over dp x sp."""
    gradient_compression: str | None = None
    """Plain engine: topk / 1bit / 2bit (its error-feedback residuals take memory)."""
    grads_bf16: bool = False
    """Plain engine: bf16 main gradients (--accumulate-grads-in-bf16)."""
    ds_fp32_grads: bool = False
    """DeepSpeed: its config sums the gradients in fp32 (data_types.grad_accum_dtype, set
    for bf16 ZeRO-3 by `config.ds_config`)."""
    saves: bool = False
    """--save is set: the run writes checkpoints (the offload gathers its state to save it)."""
    bucket_elements: int = 40_000_000
    """Plain engine: elements per gradient bucket (default Megatron's max(40M, 1M x dp x sp))."""
    reduce_bytes: int = 4
    """fsdp2: bytes per element of the gradient reduction (fp32 unless
    communication_data_type says otherwise), in which unsharded gradients accumulate."""
    fsdp_reduce_every_microbatch: bool = True
    """fsdp2 with pp > 1: reduce-scatter every micro-batch (no unsharded accumulation)."""
    fsdp_blocks_per_unit: int = ZeroConfig.fsdp_blocks_per_unit
    """fsdp2: transformer blocks sharded as one unit (--fsdp-blocks-per-unit)."""
    cp: int = 1
    """Context-parallel ranks (ring attention): they split the sequence like Ulysses' sp."""

    @property
    def name(self) -> str:
        """TP1-SP2-PP1-VPP1-DP4 (with -CPn after SP when cp > 1)."""
        cp = f"-CP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}-SP{self.sp}{cp}-PP{self.pp}-VPP{self.vpp}-DP{self.dp}"

    @property
    def seq_ranks(self) -> int:
        """Ranks that split one sequence (Ulysses x context parallel): activations, tokens
        and attention per rank divide by it, and the ZeRO group is dp x seq_ranks."""
        return self.sp * self.cp

    @property
    def param_bytes(self) -> int:
        """Bytes per element of parameters and activations in compute: 2 (bf16 / fp16) or 4."""
        return 2 if self.low_precision else 4

    @property
    def plain_engine(self) -> bool:
        """megazoo's own engine (no DeepSpeed, no FSDP2)."""
        return self.zero_impl == "none"

    @property
    def deepspeed_zero3(self) -> bool:
        """DeepSpeed at ZeRO stage 3: its parameter hooks and per-micro-batch host sync."""
        return self.zero_impl == "deepspeed" and self.zero_stage == 3

    @property
    def world_size(self) -> int:
        return self.tp * self.seq_ranks * self.pp * self.dp

    @property
    def megatron_sp_on(self) -> bool:
        """Megatron sequence parallelism in effect (it needs tp > 1)."""
        return self.megatron_sp and self.tp > 1

    def fsdp2_units(self, num_layers: int) -> tuple[int, int]:
        """(blocks in a pipeline chunk, the FSDP2 units they make): runs of
        `fsdp_blocks_per_unit` blocks, which never span chunks."""
        blocks = max(num_layers // (self.pp * self.vpp), 1)
        return blocks, -(-blocks // self.fsdp_blocks_per_unit)


def _zero(args: PretrainArgs, dp: int) -> tuple[int, str, float, str, bool]:
    """(stage, optimizer offload, offloaded ratio, parameter offload, DeepSpeed sums the
    gradients in fp32) the engine will use; the plain engine's optimizer offload:
    --optimizer-cpu-offload, its fraction."""
    zero = args.zero
    if zero.zero_impl == "deepspeed":
        ds = build_ds_config(args, dp)
        section = ds.get("zero_optimization", {}).get("offload_optimizer") or {}
        fp32 = ds.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
        result = (zero_stage(ds), offload_device(ds), float(section.get("ratio", 1.0)),
                  offload_device(ds, "offload_param"), fp32)
    elif zero.zero_impl == "fsdp2":  # CPUOffloadPolicy moves parameters and optimizer together
        cpu = "cpu" if "cpu" in (zero.offload_optimizer, zero.offload_param) else "none"
        result = (3, cpu, 1.0, cpu, False)
    else:
        t = args.training
        result = (0, "cpu" if t.optimizer_cpu_offload else "none",
                  t.optimizer_offload_fraction if t.optimizer_cpu_offload else 1.0, "none", False)
    if "nvme" in (result[1], result[3]):
        raise ValueError("the planner models cpu offload only: plan an nvme layout with "
                         "--offload-optimizer cpu / --offload-param cpu (the GPU side is the same)")
    return result


def resolve(args: PretrainArgs, options: PlanOptions | None = None) -> Resolved:
    """Check `args` as the run does and resolve it; raise ValueError naming the flag."""
    check_args(args)
    par, t = args.parallel, args.training
    dp = par.dp or 1
    stage, offload_optimizer, ratio, offload_param, ds_fp32_grads = _zero(args, dp)
    return Resolved(
        tp=par.tp, sp=par.sp, pp=par.pp, vpp=par.vpp, dp=dp,
        micro_batch_size=t.micro_batch_size, seq_length=args.data.seq_length,
        num_micro_batches=max(1, t.global_batch_size // (t.micro_batch_size * dp)),
        megatron_sp=par.megatron_sp, recompute=args.model.recompute,
        zero_impl=args.zero.zero_impl, zero_stage=stage, offload_param=offload_param,
        optimizer_offload=OptimizerOffload(
            offload_optimizer, ratio, disk=offload_optimizer == "cpu" and args.zero.nvme_path
            is not None and args.zero.zero_impl == "none",
            host_memory=t.optimizer_offload_host_memory,
            overlap=args.zero.zero_impl == "none" and t.overlap_cpu_optimizer_d2h_h2d,
            delayed=args.zero.zero_impl == "none" and t.offload_delayed_update),
        fsdp_reshard_after_forward=args.zero.fsdp_reshard_after_forward,
        options=options or PlanOptions(), low_precision=t.bf16 or t.fp16,
        distributed_optimizer=t.use_distributed_optimizer,
        gradient_compression=args.compression.algorithm,
        grads_bf16=t.accumulate_grads_in_bf16, ds_fp32_grads=ds_fp32_grads,
        saves=bool(args.checkpoint.save),
        bucket_elements=t.bucket_elements(dp * par.sp * par.cp), cp=par.cp,
        reduce_bytes=2 if args.compression.communication_data_type in ("bf16", "fp16") else 4,
        fsdp_reduce_every_microbatch=args.zero.fsdp_reduce_every_microbatch,
        fsdp_blocks_per_unit=args.zero.fsdp_blocks_per_unit)
