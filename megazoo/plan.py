"""Memory planner: what one training layout needs per GPU and on the host, and whether it fits.

    python -m megazoo.plan --model bloom-176b --dp 8 --zero-stage 3 --offload-optimizer cpu \
        --recompute full --micro-batch-size 1 --seq-length 2048 --gpu-memory 80 [--json]

`estimate_memory(config, layout)` is a pure function returning a `MemoryEstimate` (bytes).
The model (all of it stated, so a measurement can be compared part by part):

- parameters, per GPU: the most loaded pipeline stage's share per tp rank (`stage_parameters`),
  bf16 (2 B). ZeRO-3 divides them over Z = dp * sp (the ranks holding the same shard) and
  adds the gathered working set: two units of full bf16 parameters (the one computing and
  one prefetched) plus one unit's full gradient awaiting its reduce-scatter; a unit is a
  transformer block or the embedding/head (FSDP2 `fully_shard` per block).
- gradients: 2 B (bf16) or 4 B (fp32 accumulation) per parameter, / Z from ZeRO-2; with CPU
  optimizer offload they are reduced through the buckets straight to host memory.
- optimizer states: Adam in mixed precision, fp32 master + m + v = 12 B, / Z from ZeRO-1;
  moved to the host with `--offload-optimizer cpu`, together with 4 B of fp32 gradients.
- activations: what megazoo's block saves for the backward, tensor by tensor
  (`megazoo/plan_activations.py`; GPT at tp = 1: 32 s b h bytes per block, no s x s term:
  attention is a fused kernel and dropout is 0). Megatron sequence parallelism divides the
  norm inputs by t; Ulysses divides everything by sp. Selective recompute drops RoPE's
  rotated q, k and the attention output's extra copy; full recompute keeps only the block
  input (2 s b h, / t under SP) plus one block's full activations while it is recomputed.
  The first pipeline stage holds min(p, m) micro-batches under 1F1B, times
  (1 + (p - 1) / (p v)) when interleaved; the last stage adds the final norm and head inputs
  and the loss's peak: bf16 logits, their fp32 copy and fp32 exp together (10 B per element
  of s b V / (t sp)). (Korthikanti et al.'s s b h (34 + 5 a s / h) describes a block that
  stores the softmax; it overestimated ours several times over for "none".)
- communication buffers: ZeRO reduce (and, for ZeRO-1/2, all-gather) buckets of 5e8
  elements (DeepSpeed's defaults, capped at the parameters held), DDP buckets 2 x 25 MB,
  pipeline send/receive buffers; plus 1 GiB of CUDA context and library workspaces.
- fragmentation allowance: 10 % of everything above (allocator caching and splitting).
- host memory with optimizer offload: the 16 B above (times the offloaded fraction with
  ZeRO-3 partial offload); under ZeRO-3 also what DeepSpeed 0.19.8's stage3.py keeps there:
  the flat buffer of partitioned gradients in the accumulation dtype (2 B for every
  parameter, `grad_partitions_flat_buffer`), the fp32 gradient buffer of the largest
  sub-group (<= 1e9 elements) allocated while the optimizer states initialise (a peak), and
  3.2 GB of process runtime (fitted to measured peaks; bench/README.md compares predicted
  and measured host memory). ZeRO-1/2 count the 16 B only.
- `zero_impl="fsdp2"` (ZeRO-3 through FSDP2): no DeepSpeed buckets; its CPU offload keeps
  fp32 parameters, gradients and Adam m, v on the host (16 B per parameter) and only the
  gathered working set on the GPU, plus 2.5 GB of host runtime (fitted to a measured run,
  bench/README.md). Without resharding after forward (`fsdp_reshard_after_forward=False`)
  the working set is every unit of the stage, gathered: 2 B per parameter.

The claim "BLOOM-176B trains on 8x A100-80GB with ZeRO-3 + CPU optimizer offload in under
24 GB per GPU" does not hold. Optimizer offload leaves the bf16 parameters on the GPUs:
176.2e9 x 2 B / 8 = 44 GB per GPU before anything else. With full recompute, micro-batch 1
and 2048 tokens the planner puts the layout at about 83.5 GB per GPU (44 GB of parameter
shards, 12 GB of gathered parameters, 7 GB of a gathered gradient unit, 10.4 GB of
activations, buffers and a 10% allowance), so it does not fit even the 80 GB, and the
offloaded fp32 master weights, Adam moments and gradients (16 B per parameter) need 2.8 TB
of host memory on the node, 3.2 TB with DeepSpeed's buffers and runtime. Offloading the
parameters too (ZeRO-Infinity, `--offload-params cpu`) brings the GPU to about 35 GB,
bounded below by the gathered
250,880 x 14,336 embedding (3.6e9 parameters: 7.2 GB in bf16, as much again for its
gradient) and the 2.5e9-parameter blocks, and raises host memory to 3.6 TB.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .models.config import ModelConfig
from .models.params import count_parameters
from .plan_activations import activation_bytes, block_coefficients  # noqa: F401 (re-exported)

GB = 1e9
BUCKET_ELEMENTS = 5e8  # DeepSpeed reduce_bucket_size / allgather_bucket_size defaults
DDP_BUCKET_BYTES = 25e6
RUNTIME_BYTES = 2**30  # CUDA context, cuBLAS / NCCL workspaces
SUB_GROUP_ELEMENTS = 1e9  # DeepSpeed ZeRO-3 sub_group_size default
HOST_RUNTIME_BYTES = 3.2e9  # host side of an offloading process: Python, torch, CUDA, DeepSpeed
FSDP2_HOST_RUNTIME_BYTES = 2.5e9  # the same without DeepSpeed (one run: gpt-1.3b, 23.5 GB)
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class TrainingLayout:
    """A parallel layout and training settings to plan for."""

    tp: int = 1
    """Tensor-parallel size."""
    sp: int = 1
    """Ulysses sequence-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int = 1
    """Virtual pipeline chunks per stage (interleaved 1F1B)."""
    dp: int = 1
    """Data-parallel size (GPUs = tp * sp * pp * dp)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    seq_length: int = 2048
    """Tokens per sequence."""
    num_micro_batches: int | None = None
    """Micro-batches per step; None assumes at least pp (the pipeline fills)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism (only matters with tp > 1)."""
    zero_stage: int = 0
    """ZeRO stage 0-3 over the dp * sp ranks."""
    offload_optimizer: str = "none"
    """"cpu" keeps fp32 master weights, Adam moments and fp32 gradients on the host."""
    offload_ratio: float = 1.0
    """With offload_optimizer="cpu" (ZeRO-3 partial offload): the fraction of those 16 B per
    parameter on the host; the rest stays on the GPU."""
    offload_params: str = "none"
    """"cpu" (ZeRO-3 only) also keeps the bf16 parameter partitions on the host."""
    zero_impl: str = "deepspeed"
    """"deepspeed" or "fsdp2" (ZeRO-3 only; its CPU offload moves the parameters as well)."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each unit's gathered parameters after its forward (False keeps them all
    until the backward, `--no-fsdp-reshard-after-forward`: 2 B per parameter of the stage)."""
    recompute: str = "none"
    """Activation recompute: "none", "selective" or "full"."""
    fp32_grad_accumulation: bool = False
    """Accumulate gradients in fp32 (4 B) instead of bf16 (2 B)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU, in GB (1e9 bytes)."""
    gpus_per_node: int = 8
    """GPUs sharing one host, for the host-memory total per node."""

    def __post_init__(self) -> None:
        for name in ("tp", "sp", "pp", "vpp", "dp", "micro_batch_size", "seq_length", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_optimizer not in ("none", "cpu") or self.offload_params not in ("none", "cpu"):
            raise ValueError("offload_optimizer and offload_params must be 'none' or 'cpu'")
        if self.offload_params == "cpu" and self.zero_stage != 3:
            raise ValueError("offload_params=cpu needs zero_stage=3")
        if self.offload_optimizer == "cpu" and self.zero_stage == 0:
            raise ValueError("offload_optimizer=cpu needs zero_stage >= 1")
        if not 0.0 < self.offload_ratio <= 1.0 or (self.offload_ratio < 1.0 and self.zero_stage != 3):
            raise ValueError(f"offload_ratio must be in (0, 1], below 1 only with zero_stage=3; "
                             f"got {self.offload_ratio}")
        if self.zero_impl not in ("deepspeed", "fsdp2"):
            raise ValueError(f"zero_impl must be 'deepspeed' or 'fsdp2', got {self.zero_impl!r}")
        if self.zero_impl == "fsdp2" and (self.zero_stage != 3 or self.offload_ratio != 1.0):
            raise ValueError("zero_impl='fsdp2' is ZeRO-3 and offloads all or nothing: pass "
                             "zero_stage=3 and no offload_ratio")
        if not self.fsdp_reshard_after_forward and self.zero_impl != "fsdp2":
            raise ValueError("fsdp_reshard_after_forward=False is an FSDP2 setting: pass "
                             "zero_impl='fsdp2' or leave it True")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp > 1 needs pp > 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.pp * self.dp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by part (most loaded rank), host bytes, and the verdict."""

    num_parameters: int
    """Exact parameter count of the model (vocabulary padded as at this tp)."""
    parameters_per_gpu: int
    """Parameters of the most loaded stage per tp rank, before ZeRO partitioning."""
    parameters: float
    gradients: float
    optimizer_states: float
    activations: float
    communication_buffers: float
    fragmentation: float
    gpu_total: float
    host_per_gpu: float
    host_per_node: float
    fits: bool
    notes: list[str] = field(default_factory=list)

    @property
    def allocated(self) -> float:
        """What `torch.cuda.max_memory_allocated` should show: gpu_total without the
        fragmentation allowance (the allocator's cache, seen in memory_reserved) and without
        the CUDA context and library workspaces (outside the caching allocator)."""
        return (self.parameters + self.gradients + self.optimizer_states + self.activations
                + self.communication_buffers - RUNTIME_BYTES)

    def to_dict(self) -> dict:
        return {**asdict(self), "allocated": self.allocated}


def stage_parameters(config: ModelConfig, tp: int, pp: int) -> dict[str, int]:
    """Parameters per tp rank: one block, the embedding, the head, the most loaded stage."""
    h, ffn, kv = config.hidden_size, config.ffn_hidden_size, config.num_key_value_heads * config.head_dim
    norm = 2 * h if config.norm == "layernorm" else h
    mlp_mats = (3 if config.activation == "swiglu" else 2) * h * ffn
    col_bias = (h + 2 * kv) * config.qkv_bias + (2 if config.activation == "swiglu" else 1) * ffn * config.mlp_bias
    sharded = h * (h + 2 * kv) + h * h + mlp_mats + col_bias
    replicated = 2 * norm + h * config.dense_bias + h * config.mlp_bias
    block = sharded // tp + replicated
    vocab_rows = config.padded_vocab(tp) * h // tp
    embedding = vocab_rows + norm * config.embedding_layernorm
    embedding += config.max_position_embeddings * h if config.position_embedding == "learned" else 0
    head = vocab_rows if (not config.tie_word_embeddings or pp > 1) else 0
    if config.num_layers % pp:
        raise ValueError(f"num_layers {config.num_layers} must divide by pp={pp}")
    layers = config.num_layers // pp * block
    first = layers + embedding + (head + norm if pp == 1 else 0)
    last = layers + head + norm
    return dict(block=block, embedding=embedding, head=head, first=first, last=last,
                stage=max(first, last))


def estimate_memory(config: ModelConfig, layout: TrainingLayout) -> MemoryEstimate:
    """Per-GPU and host memory of training `config` in `layout` (see the module docstring)."""
    counts = stage_parameters(config, layout.tp, layout.pp)
    n_gpu = counts["stage"]
    z = layout.dp * layout.sp
    grad_b = 4 if layout.fp32_grad_accumulation else 2
    notes = []
    params = 2 * n_gpu / (z if layout.zero_stage == 3 else 1)
    grads = grad_b * n_gpu / (z if layout.zero_stage >= 2 else 1)
    optim = 12 * n_gpu / (z if layout.zero_stage >= 1 else 1)
    host = 0.0
    if layout.zero_impl == "fsdp2" and "cpu" in (layout.offload_optimizer, layout.offload_params):
        # CPUOffloadPolicy: only the working set (below) stays on the GPU
        params = grads = optim = 0.0
        host = 16 * n_gpu / z + FSDP2_HOST_RUNTIME_BYTES
        notes.append("FSDP2 CPU offload: fp32 parameters, gradients, Adam m and v on the host")
    else:
        if layout.offload_params == "cpu":
            params, host = 0.0, 2 * n_gpu / z
        if layout.offload_optimizer == "cpu":
            host += (12 + 4) * n_gpu / z * layout.offload_ratio
            optim, grads = (12 + 4) * n_gpu / z * (1.0 - layout.offload_ratio), 0.0
            notes.append("optimizer offload: fp32 master + Adam m, v + fp32 grads (16 B/param), "
                         f"{layout.offload_ratio:.0%} of them on the host")
            if layout.zero_stage == 3:  # DeepSpeed's host-side buffers and runtime
                host += (grad_b * n_gpu / z + 4 * min(n_gpu / z, SUB_GROUP_ELEMENTS)
                         + HOST_RUNTIME_BYTES)
    if layout.zero_stage == 3:
        unit = max(counts["block"], counts["embedding"], counts["head"])
        second = sorted([counts["block"], counts["block"], counts["embedding"], counts["head"]])[-2]
        grads += grad_b * unit
        if layout.fsdp_reshard_after_forward:
            params += 2 * (unit + second)
            notes.append(f"ZeRO-3 working set: 2 gathered units ({unit / 1e9:.2f}e9 + "
                         f"{second / 1e9:.2f}e9 params, bf16) + 1 unit of full gradients")
        else:  # every unit stays gathered from its forward to its backward
            params += 2 * n_gpu
            notes.append(f"FSDP2 without resharding after forward: all {n_gpu / 1e9:.2f}e9 "
                         f"params of the stage gathered (bf16) + 1 unit of full gradients")
    comm = RUNTIME_BYTES + _comm_buffers(config, layout, n_gpu, grad_b)
    act = activation_bytes(config, layout)["total"]
    subtotal = params + grads + optim + act + comm
    frag = FRAGMENTATION * subtotal
    gpu_total = subtotal + frag
    return MemoryEstimate(
        num_parameters=count_parameters(config, layout.tp), parameters_per_gpu=n_gpu,
        parameters=params, gradients=grads, optimizer_states=optim, activations=act,
        communication_buffers=comm, fragmentation=frag, gpu_total=gpu_total,
        host_per_gpu=host, host_per_node=host * min(layout.gpus_per_node, layout.world_size),
        fits=gpu_total <= layout.gpu_memory_gb * GB, notes=notes)


def _comm_buffers(config: ModelConfig, layout: TrainingLayout, n_gpu: int, grad_b: int) -> float:
    """ZeRO / DDP buckets and pipeline send/receive buffers, in bytes."""
    z = layout.dp * layout.sp
    bucket = min(BUCKET_ELEMENTS, n_gpu)
    if layout.zero_impl == "fsdp2":
        zero = 0.0  # no buckets: each unit reduce-scatters its own gradient (working set)
    elif layout.zero_stage in (1, 2):
        zero = bucket * grad_b + bucket * 2  # reduce bucket + all-gather bucket
    elif layout.zero_stage == 3:
        zero = bucket * grad_b  # reduce bucket; prefetching is in the working set
    else:
        zero = 2 * DDP_BUCKET_BYTES if z > 1 else 0.0
    seq_par = layout.sequence_parallel and layout.tp > 1
    p2p = 0.0
    if layout.pp > 1:
        p2p = 2 * 2 * layout.seq_length * layout.micro_batch_size * config.hidden_size / (
            layout.sp * (layout.tp if seq_par else 1))
    return zero + p2p


def main(argv: list[str] | None = None) -> int:
    """`python -m megazoo.plan ...`: the command line, which lives in plan_cli.py."""
    from .plan_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
