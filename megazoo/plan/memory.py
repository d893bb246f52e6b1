"""The planner's arithmetic: parameters, gradients, optimizer states, buffers, the verdict
(the model is stated in the package docstring)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..models.config import ModelConfig
from ..models.params import count_parameters, parameter_parts
from ..training.config import PretrainArgs
from .activations import stage_activations
from .layout import PlanOptions, Resolved, resolve

GB = 1e9
BUCKET_ELEMENTS = 5e8  # DeepSpeed reduce_bucket_size / allgather_bucket_size defaults
RUNTIME_BYTES = 2**30  # CUDA context, cuBLAS / NCCL workspaces
SUB_GROUP_ELEMENTS = 1e9  # DeepSpeed ZeRO-3 sub_group_size default
HOST_RUNTIME_BYTES = 3.2e9  # host side of an offloading process: Python, torch, CUDA, DeepSpeed
FSDP2_HOST_RUNTIME_BYTES = 2.5e9  # the same without DeepSpeed (one run: gpt-1.3b, 23.5 GB)
FRAGMENTATION = 0.10


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
    """Parameters per tp rank: one block, the embedding, the head, the most loaded stage
    (the parts of `count_parameters`, split as the layers split them over tp)."""
    parts = parameter_parts(config, tp)
    block = parts["layer_sharded"] // tp + parts["layer_replicated"]
    vocab_rows = parts["vocab"] // tp
    embedding = parts["embedding"] - parts["vocab"] + vocab_rows
    head = vocab_rows if (not config.tie_word_embeddings or pp > 1) else 0
    norm = parts["norm"]
    layers = config.num_layers // pp * block  # check_layout: num_layers divides by pp
    first = layers + embedding + (head + norm if pp == 1 else 0)
    last = layers + head + norm
    return dict(block=block, embedding=embedding, head=head, first=first, last=last,
                stage=max(first, last))


def estimate_memory(args: PretrainArgs, options: PlanOptions | None = None) -> MemoryEstimate:
    """Per-GPU and host memory of the run `args` describes (see the package docstring).

    `args` is the run's own configuration (what `pretrain_gpt.py` parses), checked as the run
    checks it; `args.parallel.dp` is the data-parallel size to plan for (None: 1).
    """
    return _estimate(args.model, resolve(args, options))


def activation_bytes(args: PretrainArgs, options: PlanOptions | None = None) -> dict[str, float]:
    """Activation bytes of the run `args` describes, by part (`stage_activations`)."""
    return stage_activations(args.model, resolve(args, options))


def _estimate(config: ModelConfig, layout: Resolved, n_gpu: int | None = None,
              act: float | None = None) -> MemoryEstimate:
    """The estimate of the most loaded rank; `n_gpu` (parameters per tp rank before ZeRO)
    and `act` (activation bytes) given: of the pipeline stage they describe."""
    counts = stage_parameters(config, layout.tp, layout.pp)
    n_gpu = counts["stage"] if n_gpu is None else n_gpu
    z = layout.dp * layout.sp
    grad_b = 4 if layout.options.fp32_grad_accumulation else 2
    notes = []
    params = 2 * n_gpu / (z if layout.zero_stage == 3 else 1)
    grads = grad_b * n_gpu / (z if layout.zero_stage >= 2 else 1)
    optim = 12 * n_gpu / (z if layout.zero_stage >= 1 else 1)
    host = 0.0
    if layout.plain_engine:
        params, grads, optim, grad_b = _plain_engine_bytes(layout, n_gpu, notes)
    elif layout.zero_impl == "fsdp2" and "cpu" in (layout.offload_optimizer, layout.offload_param):
        # CPUOffloadPolicy: only the working set (below) stays on the GPU
        params = grads = optim = 0.0
        host = 16 * n_gpu / z + FSDP2_HOST_RUNTIME_BYTES
        notes.append("FSDP2 CPU offload: fp32 parameters, gradients, Adam m and v on the host")
    else:
        if layout.offload_param == "cpu":
            params, host = 0.0, 2 * n_gpu / z
        if layout.offload_optimizer == "cpu":
            host += (12 + 4) * n_gpu / z * layout.offload_optimizer_ratio
            optim, grads = (12 + 4) * n_gpu / z * (1.0 - layout.offload_optimizer_ratio), 0.0
            notes.append("optimizer offload: fp32 master + Adam m, v + fp32 grads (16 B/param), "
                         f"{layout.offload_optimizer_ratio:.0%} of them on the host")
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
    act = stage_activations(config, layout)["total"] if act is None else act
    subtotal = params + grads + optim + act + comm
    frag = FRAGMENTATION * subtotal
    gpu_total = subtotal + frag
    return MemoryEstimate(
        num_parameters=count_parameters(config, layout.tp), parameters_per_gpu=n_gpu,
        parameters=params, gradients=grads, optimizer_states=optim, activations=act,
        communication_buffers=comm, fragmentation=frag, gpu_total=gpu_total,
        host_per_gpu=host, host_per_node=host * min(layout.options.gpus_per_node, layout.world_size),
        fits=gpu_total <= layout.options.gpu_memory * GB, notes=notes)


def _plain_engine_bytes(layout: Resolved, n_gpu: int, notes: list) -> tuple:
    """(parameter, gradient, optimizer bytes, gradient element size) of megazoo's own engine:
    bf16 / fp16 parameters (2 B), one contiguous fp32 main-gradient buffer (4 B; its buckets
    are views, no extra copy), fp32 masters and AdamW moments (12 B), the latter over dp x sp
    with the distributed optimizer. In fp32 the parameters are the masters (4 + 8 B) unless
    the distributed optimizer keeps a master shard of its own. Gradient compression adds its
    fp32 residuals (counted with the optimizer state): a gradient-sized worker residual, and
    for 1bit / 2bit without the distributed optimizer a 1/(dp x sp) server residual."""
    z = layout.dp * layout.sp
    shard = z if layout.distributed_optimizer else 1
    if layout.low_precision:
        params, optim = 2 * n_gpu, 12 * n_gpu / shard
    else:
        params = 4 * n_gpu
        optim = (12 if layout.distributed_optimizer else 8) * n_gpu / shard
    if layout.gradient_compression is not None and z > 1:
        server = layout.gradient_compression != "topk" and not layout.distributed_optimizer
        optim += 4 * n_gpu * (1 + (1 / z if server else 0))
        notes.append(f"gradient compression {layout.gradient_compression}: fp32 residuals")
    notes.append("megazoo engine: " + ("bf16/fp16" if layout.low_precision else "fp32")
                 + " parameters, fp32 main gradients, fp32 masters + AdamW moments"
                 + (f" sharded over dp x sp = {z}" if layout.distributed_optimizer else ""))
    return params, 4 * n_gpu, optim, 4


def _comm_buffers(config: ModelConfig, layout: Resolved, n_gpu: int, grad_b: int) -> float:
    """ZeRO / DDP buckets and pipeline send/receive buffers, in bytes."""
    z = layout.dp * layout.sp
    bucket = min(BUCKET_ELEMENTS, n_gpu)
    if layout.zero_impl == "fsdp2":
        zero = 0.0  # no buckets: each unit reduce-scatters its own gradient (working set)
    elif layout.zero_stage in (1, 2):
        zero = bucket * grad_b + bucket * 2  # reduce bucket + all-gather bucket
    elif layout.zero_stage == 3:
        zero = bucket * grad_b  # reduce bucket; prefetching is in the working set
    else:  # megazoo's engine reduces views of its main-gradient buffer in place
        zero = 0.0
    seq_par = layout.megatron_sp_on
    p2p = 0.0
    if layout.pp > 1:
        p2p = 2 * 2 * layout.seq_length * layout.micro_batch_size * config.hidden_size / (
            layout.sp * (layout.tp if seq_par else 1))
    return zero + p2p
