"""Optimizer offload in the plain engine: where its bytes go (GPU, host, disk), and the checks
a run makes before training (an unwritable `--nvme-path`, a host or disk too small: one line
each, naming the numbers). The engine and the planner's estimate both use this one model.

The model (`--optimizer-cpu-offload`, Megatron-core's flags; S = the parameters whose
optimizer state this rank holds: all of its stage, / (dp x sp) with --use-distributed-optimizer):

- optimizer state: fp32 master + AdamW m, v = 12 B per parameter of S; the fraction F
  (`--optimizer-offload-fraction`) on the host, 1 - F on the GPU (stepped there);
- with `--nvme-path` the host's share goes to disk instead (masters and moments), and the
  host keeps pinned staging buffers for NVME_STAGING_BUCKETS buckets of it (12 B per element:
  read ahead, written behind);
- transfers: each reduced gradient bucket goes down as bf16 and the updated bf16 parameters
  come up, TRANSFER_BUCKETS buckets in flight each way, in pinned host buffers (2 B per
  element each way); from fp32 main gradients the bf16 copy of a bucket is made on the GPU
  first (TRANSFER_BUCKETS x 2 B per element there), bf16 main gradients go down as they are;
- pinned host memory comes from torch's caching host allocator, which rounds every
  allocation up to a power of two (`pinned`): a 160 MB buffer takes 268 MB.

A bucket is the engine's gradient bucket (`--ddp-bucket-size`, default max(40M, 1M x dp x sp)
elements), capped at S.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass

from ..config.offload import check_offload_fraction

GB = 1e9
STATE_BYTES = 12  # fp32 master + AdamW m, v per parameter
TRANSFER_BUCKETS = 2  # gradient / parameter buckets in flight each way
NVME_STAGING_BUCKETS = 4  # disk tier: buckets of state staged on the host
WIRE_BYTES = 2  # bf16 gradients down, bf16 parameters up
UP_BUFFERS = 4  # the engine's ring of pinned parameter uploads (offload_optimizer.UP_BUFFERS)


def pinned(nbytes: float) -> float:
    """Bytes that torch's caching host allocator takes for a pinned buffer of `nbytes` (it
    rounds each allocation up to the next power of two)."""
    return 0.0 if nbytes <= 0 else float(2 ** math.ceil(math.log2(nbytes)))


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes of the optimizer offload by place (one rank)."""

    gpu_state: float
    """The GPU's share of masters and moments (1 - F)."""
    gpu_buffers: float
    """bf16 copies of fp32 gradient buckets on their way down."""
    host_state: float
    """The host's share of masters and moments (F; 0 with the disk tier)."""
    host_staging: float
    """Pinned transfer buffers, and the disk tier's staging buckets."""
    disk: float
    """What goes under --nvme-path (the host's share of the state)."""

    @property
    def host(self) -> float:
        return self.host_state + self.host_staging


def offload_bytes(state_params: float, *, fraction: float, bucket_elements: int,
                  grad_bytes: int, nvme: bool, state_bytes: int = STATE_BYTES) -> OffloadBytes:
    """The offload's bytes for `state_params` parameters of optimizer state on this rank."""
    check_offload_fraction(fraction)
    state = state_bytes * state_params
    bucket = min(bucket_elements, state_params)
    staging = 2 * TRANSFER_BUCKETS * pinned(bucket * WIRE_BYTES)  # gradients down, params up
    if nvme:
        staging += NVME_STAGING_BUCKETS * pinned(bucket * state_bytes)
    gpu_buffers = TRANSFER_BUCKETS * bucket * WIRE_BYTES if grad_bytes > WIRE_BYTES else 0.0
    host_share = fraction * state
    return OffloadBytes(gpu_state=state - host_share, gpu_buffers=gpu_buffers,
                       host_state=0.0 if nvme else host_share, host_staging=staging,
                       disk=host_share if nvme else 0.0)


def bucket_elements_of(tensors: list[int], bucket_elements: int, pad_to: int) -> list[int]:
    """The engine's gradient buckets (`grad_buffer._layout`): the parameters in reverse, each
    bucket closed once it holds `bucket_elements`, padded to a multiple of `pad_to` (dp x sp)."""
    out, current = [], 0
    for numel in reversed(tensors):
        current += numel
        if current >= bucket_elements:
            out.append(-(-current // pad_to) * pad_to)
            current = 0
    return out + ([-(-current // pad_to) * pad_to] if current else [])


def host_slots(buckets: list[int], fraction: float, shard: int) -> list[float]:
    """Elements of each bucket whose state goes to the host (`cpu_offload.host_share`: the
    first buckets while that brings the share nearer `fraction`), / `shard` per rank."""
    target, taken, out = fraction * sum(buckets), 0, []
    for numel in buckets:
        if taken + numel / 2 > target:
            break
        out.append(numel / shard)
        taken += numel
    return out


def pinned_host_bytes(slots: list[float], grad_bytes: int, param_bytes: int) -> float:
    """Host bytes of the engine's offload in memory: per host slot its fp32 master, m and v
    and its gradient's landing buffer, each pinned; a ring of UP_BUFFERS pinned uploads of
    the largest slot's parameters; bf16 gradients' fp32 upcast scratch (pageable)."""
    largest = max(slots, default=0.0)
    state = sum(3 * pinned(4 * s) + pinned(grad_bytes * s) for s in slots)
    scratch = 4 * largest if grad_bytes < 4 else 0.0
    return state + UP_BUFFERS * pinned(param_bytes * largest) + scratch


def check_nvme_path(path: str) -> float:
    """Create `path` if needed, check that a file can be written there, and return the free
    bytes of its file system; ValueError naming the path otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".megazoo-write-test"):
            pass
        return float(shutil.disk_usage(path).free)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--nvme-path {path} is not a writable folder ({reason}): pass a "
                         "folder on a local disk you can write to") from None


def host_memory_bytes() -> float | None:
    """Memory the host can give this process now (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_offload_plan(host_needed: float, disk_needed: float, *, host_memory: float | None,
                       disk_memory: float | None, nvme_path: str | None = None,
                       ranks_per_host: int = 1) -> None:
    """ValueError (one line, the numbers in GB) when the host or the disk cannot hold what the
    plan puts there; `host_memory` / `disk_memory` None: not checked. `host_needed` and
    `disk_needed` are one rank's; `ranks_per_host` ranks share the host and the disk."""
    host_all, disk_all = host_needed * ranks_per_host, disk_needed * ranks_per_host
    ranks = f" ({ranks_per_host} ranks x {host_needed / GB:.1f} GB)" if ranks_per_host > 1 else ""
    if host_memory is not None and host_all > host_memory:
        advice = ("pass --nvme-path DIR to keep the optimizer state on disk" if not nvme_path
                  else "use a smaller model or more GPUs")
        raise ValueError(f"the plan needs {host_all / GB:.1f} GB of host memory{ranks} but "
                         f"{host_memory / GB:.1f} GB is available: lower "
                         f"--optimizer-offload-fraction (more state on the GPU) or {advice}")
    if disk_all > 0 and disk_memory is not None and disk_all > disk_memory:
        where = f"under --nvme-path {nvme_path}" if nvme_path else "on the disk"
        raise ValueError(f"the plan needs {disk_all / GB:.1f} GB {where} but "
                         f"{disk_memory / GB:.1f} GB is free: free space there, point "
                         "--nvme-path at a larger disk, or lower --optimizer-offload-fraction")

