"""Parameter, gradient and optimizer bytes of each engine, on the GPU, the host and the disk
(`memory._estimate` adds activations, buffers and the verdict). Every function returns a
`Parts` for the most loaded rank, given the parameters of its stage per tp rank (`n`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config.model import ModelConfig
from .layout import Resolved
from .deepspeed_host import SUB_GROUP_ELEMENTS, sub_groups, zero3_cpu_offload_host
from ..offload import (GB, HostSplit, bucket_elements_of, check_offload_plan, host_slots,
                       host_split, offload_bytes, pinned, split_budget)
from .tensors import model_tensors

TORCH_HOST_RUNTIME_BYTES = 1.39e9  # host side of a process without DeepSpeed (FSDP2 gpt-1.3b: 23.5 GB)


@dataclass
class Parts:
    """Bytes by part: GPU (params, grads, optim, buffers), host, disk, the build's peak."""

    params: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    buffers: float = 0.0
    host: float = 0.0
    disk: float = 0.0
    build: float = 0.0
    """GPU bytes allocated while the run builds its model and the engine takes it over:
    `run.py` builds the model in fp32 on the device (4 B per parameter) before the engine
    casts, shards or offloads it; the offloaded plain engine in bf16 / fp16 instead moves
    each sub-module to the host as it is built (`training/backends/lean_build.py`)."""
    step: float = 0.0
    """GPU bytes the optimizer step adds for a moment (torch AdamW's temporaries), while the
    gathered parameters and the activations are gone (`memory._estimate`)."""
    notes: list[str] = field(default_factory=list)


def plain_parts(config: ModelConfig, layout: Resolved, n: int, unit: float = 0.0) -> Parts:
    """megazoo's own engine: bf16 / fp16 parameters (2 B), one contiguous main-gradient buffer
    (fp32, 4 B; bf16 with --accumulate-grads-in-bf16; its buckets are views), fp32 masters and
    AdamW moments (12 B), the latter over dp x sp with the distributed optimizer. In fp32 the
    parameters are the masters (4 + 8 B) unless the distributed optimizer keeps a master shard
    of its own. With --optimizer-cpu-offload a fraction of the optimizer state lives on the
    host and the disk (`_offload_parts`). Gradient compression adds its fp32 residuals
    (counted with the optimizer state): a gradient-sized worker residual, and for 1bit / 2bit
    without the distributed optimizer a 1/(dp x sp) server residual. Build: the fp32 model
    (it doubles as the masters until the cast), the main gradients, the moments kept on the
    GPU, and the bf16 copy made by the cast. The lean build (bf16 / fp16 with `OffloadAdamW`:
    offload or bf16 main gradients) instead holds one sub-module's fp32 parameters at a time
    (at most `unit` elements: a block, the embedding or the head), then the bf16 buffer, the
    main gradients and the GPU share's fp32 initial masters; the host holds the fp32 model
    (4 B per parameter) while the engine starts, its peak if that exceeds training's."""
    z = layout.dp * layout.seq_ranks
    shard = z if layout.distributed_optimizer else 1
    grad_b = 2 if layout.grads_bf16 else 4
    state_b = 12 if (layout.low_precision or layout.distributed_optimizer) else 8
    parts = Parts(params=layout.param_bytes * n, grads=grad_b * n, optim=state_b * n / shard)
    parts.notes.append("megazoo engine: " + ("bf16/fp16" if layout.low_precision else "fp32")
                       + f" parameters, {'bf16' if grad_b == 2 else 'fp32'} main gradients, fp32 "
                       "masters + AdamW moments"
                       + (f" sharded over dp x sp = {z}" if layout.distributed_optimizer else ""))
    if layout.optimizer_offload.on:
        _offload_parts(parts, config, layout, n, shard, grad_b, state_b)
    if layout.gradient_compression is not None and z > 1:
        server = layout.gradient_compression != "topk" and not layout.distributed_optimizer
        parts.optim += 4 * n * (1 + (1 / z if server else 0))
        parts.notes.append(f"gradient compression {layout.gradient_compression}: fp32 residuals")
    if layout.low_precision and (layout.optimizer_offload.on or layout.grads_bf16):
        masters = parts.optim * (4 / state_b)  # the GPU share's initial fp32 masters
        parts.build = max(4 * unit, parts.params + parts.grads + masters)
        parts.host = max(parts.host, 4 * n + TORCH_HOST_RUNTIME_BYTES)
        parts.notes.append("lean build: one sub-module in fp32 on the GPU at a time, the fp32 "
                           "model on the host while the engine starts")
        return parts
    moments_on_gpu = parts.optim * (8 / state_b) if state_b == 12 else parts.optim
    cast = 2 * n if layout.low_precision else 0.0
    parts.build = 4 * n + grad_b * n + moments_on_gpu + cast
    return parts


def _offload_parts(parts: Parts, config: ModelConfig, layout: Resolved, n: int, shard: int,
                   grad_b: int, state_b: int) -> None:
    """--optimizer-cpu-offload: the GPU share (`offload.offload_bytes`), the engine's host
    slots (its buckets, `offload.host_slots`) and where they live (`offload.host_split`:
    with --nvme-path, in memory while they fit the budget, the rest on disk). Both sides
    step with the one-pass kernels: no fp32 gradient scratch (`offload`'s docstring)."""
    off = offload_bytes(n / shard, fraction=layout.optimizer_offload.ratio,
                        bucket_elements=layout.bucket_elements, grad_bytes=grad_b,
                        state_bytes=state_b)
    parts.optim, parts.buffers = off.gpu_state, off.gpu_buffers
    slots, split = planned_split(config, layout, n)
    if layout.optimizer_offload.host_memory is not None:  # the engine's check, same words
        ranks = min(layout.options.gpus_per_node, layout.world_size)
        check_offload_plan(split.host, 0.0,
                           host_memory=layout.optimizer_offload.host_memory * GB * ranks,
                           disk_memory=None, nvme_path="--nvme-path", ranks_per_host=ranks)
    parts.host, parts.disk = split.host + TORCH_HOST_RUNTIME_BYTES, split.disk
    if layout.saves:  # OffloadAdamW.full_state: full flat fp32 masters, m and v
        parts.host += 12 * n
        parts.notes.append(f"checkpoint save: {12 * n / 1e9:.1f} GB of full fp32 masters "
                           "and moments on the host while a checkpoint is written")
    where = "the host"
    if split.disk:
        on_disk = len(slots) - split.memory
        where += (f" ({split.memory} buckets in memory, the last {on_disk} of the forward on "
                  f"disk under --nvme-path: {split.disk / GB:.1f} GB)")
    elif layout.optimizer_offload.disk:
        where += " (all in memory: --nvme-path holds nothing)"
    parts.notes.append(f"optimizer offload: {layout.optimizer_offload.ratio:.0%} of the "
                       f"masters and moments ({state_b} B/param) on {where}")


def planned_split(config: ModelConfig, layout: Resolved, n: int) -> tuple[list[float], HostSplit]:
    """(host slots in forward order, their `offload.host_split`) of the offloaded plain
    engine with `n` parameters per GPU: its buckets (`offload.bucket_elements_of`), the host
    share of them (`offload.host_slots`, elements per rank) and where each lives, by the
    engine's own rule with the host budget it computes (`split_host_budget`)."""
    z = layout.dp * layout.seq_ranks
    tensors = [t for t, _ in model_tensors(config, layout.tp, config.num_layers // layout.pp,
                                           last=layout.pp == 1)]
    # a tied embedding's copy on a pipeline end waits for its sum: a bucket of its own
    tied = layout.pp > 1 and config.tie_word_embeddings
    buckets = bucket_elements_of(tensors, layout.bucket_elements, z, {0} if tied else set())
    shard = z if layout.distributed_optimizer else 1
    forward = host_slots(buckets, layout.optimizer_offload.ratio, shard)[::-1]
    return forward, host_split(forward, split_host_budget(layout, n),
                               grad_bytes=2 if layout.grads_bf16 else 4,
                               param_bytes=layout.param_bytes)


def split_host_budget(layout: Resolved, n: int) -> float | None:
    """Host bytes the offload may take with --nvme-path (`offload.split_budget`, as the
    engine computes it): --optimizer-offload-host-memory, else this rank's share of
    --host-memory less its runtime; None without the disk tier or a host size (all in
    memory)."""
    if not layout.optimizer_offload.disk:
        return None
    if layout.optimizer_offload.host_memory is not None:
        return layout.optimizer_offload.host_memory * GB
    opts = layout.options
    if not opts.host_memory:
        return None
    ranks = min(opts.gpus_per_node, layout.world_size)
    available = opts.host_memory * GB / ranks - TORCH_HOST_RUNTIME_BYTES
    return split_budget(available, n if layout.saves else 0)


def deepspeed_parts(config: ModelConfig, layout: Resolved, n: int, grad_b: int) -> Parts:
    """DeepSpeed ZeRO-1/2/3 (0.19.8's stage3.py for ZeRO-3): parameters in the compute dtype
    (/ Z at ZeRO-3), gradient partitions in the accumulation dtype (`grad_b`, / Z from
    ZeRO-2), fp32 masters + Adam m, v (12 B; fp32 runs: the parameters are the masters, 8 B)
    / Z. ZeRO-3 adds the fp32 gradient buffer of the largest sub-group (<= 1e9 elements) on
    the GPU, or, with optimizer offload to cpu, keeps fp32 masters, moments and gradients on
    the host (also in fp32 runs), with pinned buffers rounded to powers of two
    (`deepspeed_host`); offloaded ZeRO-3 parameters are one pinned buffer per group."""
    z = layout.dp * layout.seq_ranks
    stage, ratio = layout.zero_stage, layout.optimizer_offload.ratio
    per = n / z
    state_b = 12 if layout.low_precision else 8
    parts = Parts(params=layout.param_bytes * n / (z if stage == 3 else 1),
                  grads=grad_b * n / (z if stage >= 2 else 1),
                  optim=state_b * n / (z if stage >= 1 else 1), build=4 * n)
    groups = sub_groups(config, layout.tp, z) if stage == 3 else []
    if layout.offload_param == "cpu":
        parts.params = 0.0
        parts.host = sum(pinned(layout.param_bytes * g) for g in sub_groups(config, layout.tp, z,
                                                                          size=math.inf))
    if layout.optimizer_offload.on:  # the host keeps an fp32 master copy in fp32 runs too
        # ZeRO-3 steps its first int((1 - ratio) x count) sub-groups on the GPU (the ratio is
        # 1 below ZeRO-3: the config refuses others)
        on_gpu = int((1 - ratio) * len(groups))
        parts.host += zero3_cpu_offload_host(groups, ratio, grad_b) if stage == 3 else 16 * per
        parts.optim, parts.grads = 16 * sum(groups[:on_gpu]), 0.0
        parts.notes.append(f"optimizer offload: fp32 masters + Adam m, v + fp32 grads on the "
                           f"host" + (f", {len(groups) - on_gpu} of {len(groups)} sub-groups"
                                      if ratio < 1 else ""))
    elif stage >= 1:  # torch AdamW (single-tensor) on
        # a flat fp32 group: sqrt(v), then that / its bias correction, both alive at once
        largest = max(groups) if groups else per
        parts.step = 8 * largest
        parts.notes.append(f"DeepSpeed optimizer step: AdamW temporaries {parts.step / 1e9:.2f} "
                           "GB (8 B x the largest flat group)")
    if stage == 3 and not layout.optimizer_offload.on:
        parts.grads += 4 * min(per, SUB_GROUP_ELEMENTS)
        parts.notes.append("DeepSpeed ZeRO-3: fp32 gradient buffer of the largest sub-group")
    return parts


def fsdp2_parts(config: ModelConfig, layout: Resolved, n: int, unit: float = 0.0) -> Parts:
    """FSDP2 (`fully_shard` per block, MixedPrecisionPolicy): fp32 sharded parameters and
    gradients and AdamW m, v (16 B / Z); with CPUOffloadPolicy all of them on the host, the
    parameters and gradients pinned (each tensor's shard rounded up to a power of two,
    `pinned`). Several micro-batches per step with the reduce-scatter only in the last one
    (always at pp = 1; `--no-fsdp-reduce-every-microbatch` under pipelines) keep every
    parameter's unsharded gradient in the reduction dtype (fp32 for bf16 runs) on the GPU
    across the step: FSDP2's `unsharded_accumulated_grad`, not divided by Z; the last
    micro-batch's reduce-scatter frees it unit by unit as the sharded gradients appear, so
    the gradients take the larger of the two, not their sum. Build: the fp32 model, and the
    sharded copy of the unit (`unit` elements) `fully_shard` is making."""
    z = layout.dp * layout.seq_ranks
    parts = Parts(params=4 * n / z, grads=4 * n / z, optim=8 * n / z, build=4 * (n + unit / z))
    if layout.optimizer_offload.on:
        shards = _pinned_shards(config, layout.tp, layout.pp, z)
        parts.host = 2 * shards + 8 * n / z + TORCH_HOST_RUNTIME_BYTES
        parts.params = parts.grads = parts.optim = 0.0
        parts.notes.append("FSDP2 CPU offload: fp32 parameters and gradients (pinned, rounded "
                           "to powers of two) and Adam m, v on the host")
    last_only = layout.pp == 1 or not layout.fsdp_reduce_every_microbatch
    if layout.num_micro_batches > 1 and last_only:  # a unit's sharded gradient replaces its
        parts.grads = max(parts.grads, layout.reduce_bytes * n)  # unsharded one at the reduce
        parts.notes.append(f"FSDP2 accumulates unsharded gradients over "
                           f"{layout.num_micro_batches} micro-batches: {layout.reduce_bytes} B "
                           f"for every parameter of the stage on the GPU")
    return parts


def _pinned_shards(config: ModelConfig, tp: int, pp: int, z: int) -> float:
    """Pinned bytes of one fp32 copy of the most loaded stage's FSDP2 shards."""
    def shards(tensors):
        return sum(pinned(4 * math.ceil(numel / z)) for numel, _ in tensors)

    blocks = config.num_layers // pp * shards(model_tensors(config, tp, 1, False, False))
    first = shards(model_tensors(config, tp, 0, True, False))
    last = shards(model_tensors(config, tp, 0, False, True))
    return blocks + first + last if pp == 1 else blocks + max(first, last)
