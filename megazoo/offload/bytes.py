"""Optimizer offload in the plain engine: where its bytes go (GPU, host, disk). The engine
(`training/backends`) and the planner's estimate (`plan/engines.py`) both use this one model;
the checks a run makes before training are `checks.py`, the buckets `buckets.py`.

The model (`--optimizer-cpu-offload`, Megatron-core's flags; S = the parameters whose
optimizer state this rank holds: all of its stage, / (dp x sp) with --use-distributed-optimizer):

- optimizer state: fp32 master + AdamW m, v = 12 B per parameter of S; the fraction F
  (`--optimizer-offload-fraction`, whole buckets, the last of the forward) on the host,
  1 - F on the GPU (stepped there);
- the host share, per bucket ("host slot"): its state in three fp32 tensors (pinned; pageable
  with the disk tier), and a pinned landing buffer for its reduced gradient (the gradient's
  dtype); a ring of UP_BUFFERS pinned buffers carries the updated parameters up;
- with `--nvme-path` the host share is split (`host_split`): the slots the forward uses
  first keep their state in memory while it fits the host budget (`split_budget`: what the
  host has available at start, less HOST_RESERVE and the state a saving run gathers; or
  --optimizer-offload-host-memory), the rest live on disk (12 B per element, each file
  padded to 4 KiB), streamed through STORE_SLOTS staging slots (pageable: only the host
  reads them); the gradients of a split host share go down in their slot's host step
  through one shared pinned buffer;
- on the GPU, from fp32 main gradients the bf16 copy of a bucket is made first
  (TRANSFER_BUCKETS x 2 B per element), bf16 main gradients go down as they are;
- the step: the one-pass AdamW kernels (`kernels.host_adamw` on the host,
  `kernels.triton_adamw` on the GPU) read bf16 gradients as they are, so neither side holds
  an fp32 copy of a bucket. Where one is missing (no C compiler, no Triton) torch's AdamW
  steps over an fp32 scratch of that side's largest slot (4 B per element, 160 MB at
  40M-element buckets): the engine's split counts its host scratch (`host_split`'s
  `scratch`), the plan counts neither, as the CUDA runs it plans have both (Triton builds
  its own launcher with the same system C compiler);
- pinned host memory comes from torch's caching host allocator, which rounds every
  allocation up to a power of two (`pinned`): a 160 MB buffer takes 268 MB.

A bucket is the engine's gradient bucket (`--ddp-bucket-size`, default max(40M, 1M x dp x sp)
elements), capped at S.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.offload import check_offload_fraction

GB = 1e9
STATE_BYTES = 12  # fp32 master + AdamW m, v per parameter
TRANSFER_BUCKETS = 2  # bf16 copies of fp32 gradient buckets on the GPU
WIRE_BYTES = 2  # bf16 gradients down, bf16 parameters up
UP_BUFFERS = 4  # the engine's ring of pinned parameter uploads
STORE_SLOTS = 2  # the disk tier's staging slots (NvmeStateStore's default)
DISK_ALIGN = 4096  # the disk tier pads each file to this (state_store.ALIGN)
HOST_RESERVE = 4e9  # host bytes the split leaves free for everything else the run allocates


def pinned(nbytes: float) -> float:
    """Bytes that torch's caching host allocator takes for a pinned buffer of `nbytes` (it
    rounds each allocation up to the next power of two)."""
    return 0.0 if nbytes <= 0 else float(2 ** math.ceil(math.log2(nbytes)))


@dataclass(frozen=True)
class OffloadBytes:
    """GPU bytes of the optimizer offload (one rank); the host's and the disk's: `host_split`."""

    gpu_state: float
    """The GPU's share of masters and moments (1 - F)."""
    gpu_buffers: float
    """bf16 copies of fp32 gradient buckets on their way down."""


def offload_bytes(state_params: float, *, fraction: float, bucket_elements: int,
                  grad_bytes: int, state_bytes: int = STATE_BYTES) -> OffloadBytes:
    """The offload's GPU bytes for `state_params` parameters of optimizer state on this rank."""
    check_offload_fraction(fraction)
    state = state_bytes * state_params
    bucket = min(bucket_elements, state_params)
    gpu_buffers = TRANSFER_BUCKETS * bucket * WIRE_BYTES if grad_bytes > WIRE_BYTES else 0.0
    return OffloadBytes(gpu_state=state - fraction * state, gpu_buffers=gpu_buffers)


@dataclass(frozen=True)
class HostSplit:
    """Where the host share of the state lives (`host_split`), and its bytes."""

    memory: int
    """Host slots, counted in forward order, whose state stays in host memory (pinned, or
    pageable in a split); the others, the last of the forward, live on disk."""
    host: float
    """Host bytes of the offload: in-memory state, gradient landing buffers, the upload
    ring, the disk tier's staging slots (and a fallback step's fp32 scratch)."""
    disk: float
    """Bytes of the disk tier's files."""
    late: bool = False
    """Gradients go down in their slot's host step, through one shared pinned buffer."""
    pageable: bool = False
    """The state in memory is pageable (the budget did not hold it all pinned)."""


def disk_span(numel: float) -> float:
    """Bytes of one slot's file on disk: master, m, v (fp32), padded to DISK_ALIGN
    (`state_store.NvmeStateStore._span`)."""
    return math.ceil(STATE_BYTES * numel / DISK_ALIGN) * DISK_ALIGN


def host_split(slots: list[float], budget: float | None, *, grad_bytes: int,
               param_bytes: int, late_grads: bool = True, scratch: float = 0.0) -> HostSplit:
    """The split rule, which the engine (`split_store.host_store`) and the planner both apply.

    `slots`: elements of each host slot in forward order; `budget`: host bytes the offload may
    take (None: no disk tier, all in memory); `scratch`: host bytes of the step's fp32
    gradient scratch (`cpu_offload.SlotAdamW.scratch_bytes`: 0 with the one-pass C kernel,
    which reads bf16 gradients as they are; the engine passes what its step allocates, the
    planner 0). Always: UP_BUFFERS pinned uploads of the largest slot's parameters, and the
    scratch. If every slot's state (three fp32 tensors, pinned) and a pinned landing buffer
    for its reduced gradient fit the budget beside them, all stays in memory (the in-memory
    offload, as measured). Otherwise: the state in memory is pageable (12 B per element:
    only the host reads it, every copy goes through the pinned buffers); with `late_grads`
    the gradients go down in their slot's host step through one shared pinned buffer
    instead of one each (the next backward waits for the host step anyway: its forward
    needs the new parameters); the disk tier's STORE_SLOTS staging slots (pageable too) for
    the largest slot are set aside; and slots stay in memory, in forward order, while they
    fit what is left: the first that does not and every later one go to disk. Disk slots are
    thus the last the forward uses: the host step
    reaches them last and starts reading them as it starts. `late_grads` False (the delayed
    update, whose host step overlaps the next backward): every slot keeps its own landing
    buffer."""
    largest = max(slots, default=0.0)
    landing = [pinned(grad_bytes * s) for s in slots]
    fixed = UP_BUFFERS * pinned(param_bytes * largest) + scratch
    pinned_state = [3 * pinned(4 * s) for s in slots]
    if budget is None or fixed + sum(landing) + sum(pinned_state) <= budget:
        return HostSplit(len(slots), fixed + sum(landing) + sum(pinned_state), 0.0, False)
    state = [STATE_BYTES * s for s in slots]
    fixed += pinned(grad_bytes * largest) if late_grads else sum(landing)
    left, memory = budget - fixed - STORE_SLOTS * disk_span(largest), 0
    while memory < len(slots) and state[memory] <= left:
        left -= state[memory]
        memory += 1
    disk = slots[memory:]
    staging = STORE_SLOTS * disk_span(max(disk)) if disk else 0.0
    return HostSplit(memory, fixed + sum(state[:memory]) + staging,
                     float(sum(disk_span(s) for s in disk)), late_grads, pageable=True)


def split_budget(available: float, saved_numel: float = 0.0) -> float:
    """Host bytes the offload may take when `available` bytes are free to this rank: all but
    HOST_RESERVE, and, for a run that saves, the full fp32 masters and moments its
    checkpoint gathers (`saved_numel` elements, STATE_BYTES each)."""
    return available - HOST_RESERVE - STATE_BYTES * saved_numel
