"""The planner's arithmetic: parameters, gradients, optimizer states, buffers, the verdict
(per engine: `engines.py`; activations: `activations.py`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config.model import ModelConfig
from ..config.run import PretrainArgs
from ..models.params import count_parameters, parameter_parts
from .activations import stage_activations
from .engines import Parts, deepspeed_parts, fsdp2_parts, plain_parts
from .layout import PlanOptions, Resolved, resolve
from ..offload import GB

BUCKET_ELEMENTS = 5e8  # DeepSpeed reduce_bucket_size / allgather_bucket_size defaults
RUNTIME_BYTES = 2**30  # CUDA context, cuBLAS / NCCL workspaces
LIVE_ELEMENTS = 5e8  # DeepSpeed ZeRO-3 keeps gathered what is reused within 1e9 elements
# (stage3_max_reuse_distance): under recompute, the last 1e9 / 2 of the forward
FRAGMENTATION = 0.10  # allowance for the allocator's caching and splitting


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by part (most loaded rank), host and disk bytes, and the verdict."""

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
    build_peak: float = 0.0
    """GPU bytes allocated while the model is built and handed to the engine (fp32 first)."""
    step_peak: float = 0.0
    """GPU bytes (with the CUDA context) during the optimizer step, where its temporaries
    outweigh the gathered parameters and activations it does not hold (0: not modelled)."""
    disk_per_gpu: float = 0.0
    """Bytes under --nvme-path per GPU (plain engine's disk tier)."""
    disk_per_node: float = 0.0
    verdicts: dict = field(default_factory=dict)
    """{"gpu" / "host" / "disk": fits}: which budget the plan fits (the host and the disk only
    where --host-memory / --disk-memory are given)."""

    @property
    def allocated(self) -> float:
        """What `torch.cuda.max_memory_allocated` should show over training steps: gpu_total
        without the fragmentation allowance (the allocator's cache, seen in memory_reserved)
        and without the CUDA context and library workspaces (outside the caching allocator)."""
        return max(self.parameters + self.gradients + self.optimizer_states + self.activations
                   + self.communication_buffers, self.step_peak) - RUNTIME_BYTES

    @property
    def peak_allocated(self) -> float:
        """`max_memory_allocated` over the whole run, the model's build included (what
        pretrain_gpt.py logs as gpu_max_allocated_gb)."""
        return max(self.allocated, self.build_peak)

    def to_dict(self) -> dict:
        return {**asdict(self), "allocated": self.allocated, "peak_allocated": self.peak_allocated}


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
    return dict(block=block, embedding=embedding, head=head, norm=norm, first=first, last=last,
                stage=max(first, last))


def rank_parameters(config: ModelConfig, tp: int, layers: list[int]) -> list[int]:
    """Parameters per tp rank of each pipeline rank, rank r holding `layers[r]` blocks: plus
    the embedding on the first, the head and the final norm on the last."""
    counts = stage_parameters(config, tp, len(layers))
    held = [counts["block"] * n for n in layers]
    held[0] += counts["embedding"]
    held[-1] += counts["head"] + counts["norm"]
    return held


def estimate_memory(args: PretrainArgs, options: PlanOptions | None = None) -> MemoryEstimate:
    """Per-GPU, host and disk memory of the run `args` describes.

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
    fp32_grads = layout.options.fp32_grad_accumulation or layout.ds_fp32_grads
    grad_b = 4 if (fp32_grads or not layout.low_precision) else 2
    unit = max(counts["block"], counts["embedding"], counts["head"])  # the largest unit
    if layout.plain_engine:
        parts = plain_parts(config, layout, n_gpu, unit)
    elif layout.zero_impl == "fsdp2":
        parts = fsdp2_parts(config, layout, n_gpu, unit)
    else:
        parts = deepspeed_parts(config, layout, n_gpu, grad_b)
    persistent = parts.params + parts.grads
    if layout.zero_stage == 3:
        _working_set(parts, layout, counts, n_gpu, config.num_layers)
    comm = RUNTIME_BYTES + parts.buffers + _comm_buffers(config, layout, n_gpu, grad_b)
    act = stage_activations(config, layout)["total"] if act is None else act
    subtotal = parts.params + parts.grads + parts.optim + act + comm
    # the optimizer step: its temporaries, without the gathered parameters and activations
    step = persistent + parts.optim + comm + parts.step if parts.step else 0.0
    subtotal = max(subtotal, step)
    frag = FRAGMENTATION * subtotal
    gpu_total = subtotal + frag
    ranks = min(layout.options.gpus_per_node, layout.world_size)
    opts = layout.options
    verdicts = {"gpu": max(gpu_total, parts.build + RUNTIME_BYTES) <= opts.gpu_memory * GB}
    if opts.host_memory:
        verdicts["host"] = parts.host * ranks <= opts.host_memory * GB
    if opts.disk_memory and parts.disk:
        verdicts["disk"] = parts.disk * ranks <= opts.disk_memory * GB
    notes = parts.notes
    if parts.build + RUNTIME_BYTES > opts.gpu_memory * GB >= gpu_total:
        notes.append(f"the model is built in fp32 on the GPU first ({parts.build / GB:.1f} GB "
                     "allocated then): that, not training, does not fit")
    return MemoryEstimate(
        num_parameters=count_parameters(config, layout.tp), parameters_per_gpu=n_gpu,
        parameters=parts.params, gradients=parts.grads, optimizer_states=parts.optim,
        activations=act, communication_buffers=comm, fragmentation=frag, gpu_total=gpu_total,
        host_per_gpu=parts.host, host_per_node=parts.host * ranks, fits=all(verdicts.values()),
        notes=notes, build_peak=parts.build, step_peak=step, disk_per_gpu=parts.disk,
        disk_per_node=parts.disk * ranks, verdicts=verdicts)


def _working_set(parts: Parts, layout: Resolved, counts: dict, n_gpu: int,
                 num_layers: int) -> None:
    """ZeRO-3's gathered parameters (compute dtype): two units (one computing, one
    prefetched), or every unit without resharding after forward, plus one unit's full
    gradient awaiting its reduce-scatter; a unit is a block (FSDP2: --fsdp-blocks-per-unit
    blocks, at most a chunk's, `Resolved.fsdp2_units`) or the embedding / head."""
    block, blocks = counts["block"], [counts["block"]] * 2
    if layout.zero_impl == "fsdp2":
        chunk_blocks, units = layout.fsdp2_units(num_layers)
        block *= min(layout.fsdp_blocks_per_unit, chunk_blocks)
        blocks = [block] * min(2, layout.vpp * units)
    unit = max(block, counts["embedding"], counts["head"])
    second = sorted(blocks + [counts["embedding"], counts["head"]])[-2]
    b = layout.param_bytes
    parts.grads += b * unit
    if layout.zero_impl == "deepspeed":  # its coordinator keeps what is reused soon gathered
        live = max(unit + second, min(n_gpu, LIVE_ELEMENTS))
        parts.params += b * live
        parts.notes.append(f"DeepSpeed ZeRO-3 working set: {live / 1e9:.2f}e9 gathered params "
                           f"({b} B, reused within stage3_max_reuse_distance) + 1 unit of "
                           "full gradients")
    elif layout.fsdp_reshard_after_forward:
        parts.params += b * (unit + second)
        parts.notes.append(f"ZeRO-3 working set: 2 gathered units ({unit / 1e9:.2f}e9 + "
                           f"{second / 1e9:.2f}e9 params, {b} B) + 1 unit of full gradients")
    else:  # every unit stays gathered from its forward to its backward
        parts.params += b * n_gpu
        parts.notes.append(f"FSDP2 without resharding after forward: all {n_gpu / 1e9:.2f}e9 "
                           f"params of the stage gathered ({b} B) + 1 unit of full gradients")


def _comm_buffers(config: ModelConfig, layout: Resolved, n_gpu: int, grad_b: int) -> float:
    """ZeRO / DDP buckets and pipeline send/receive buffers, in bytes."""
    if layout.zero_stage in (1, 2):  # DeepSpeed's reduce bucket + all-gather bucket
        zero = min(BUCKET_ELEMENTS, n_gpu) * (grad_b + 2)
    elif layout.deepspeed_zero3:
        zero = BUCKET_ELEMENTS * layout.param_bytes  # the reduce bucket, allocated whole
    else:  # FSDP2 reduce-scatters each unit's gradient (working set); megazoo's engine reduces
        zero = 0.0  # views of its main-gradient buffer in place
    shard = layout.seq_ranks * (layout.tp if layout.megatron_sp_on else 1)
    activation = 2 * layout.seq_length * layout.micro_batch_size * config.hidden_size / shard
    return zero + (2 * activation if layout.pp > 1 else 0.0)  # pipeline send + receive
