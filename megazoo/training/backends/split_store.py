"""The host share of `OffloadAdamW`'s state, split between pinned host memory and the disk
tier (--nvme-path): which host slots live where, one store over both, and the check of the
host and the disk before training.

    store, split = host_store(plan, host_slots, pin=..., rank=..., grad_bytes=...,
                              param_bytes=..., initial=..., numel=...)
    store.acquire(i) / store.prefetch(i) / store.release(i) / store.flush()
    store.on_disk(i)                 # whether host slot i streams from disk

The rule is `offload.bytes.host_split`, the one the planner applies: with the disk tier, the
host slots the forward uses first keep their state in memory while it fits the host budget,
the rest (the last of the forward) live on disk; everything in memory when it all fits. The
budget: --optimizer-offload-host-memory, or this rank's share of the host's available
memory at start (MemAvailable, plus the fp32 initial values the masters' fill frees, over the
ranks on this host) less `offload.bytes.HOST_RESERVE` and, when the run saves, the full fp32
state its checkpoint gathers (`split_budget`). `python -m megazoo.plan ... --host-memory GB`
prints the same split for a host of that size.
"""
from __future__ import annotations

import math
import os

from ...offload.bytes import host_split, split_budget
from ...offload.checks import check_nvme_path, check_offload_plan, gb_text, host_memory_bytes
from .cpu_offload import ResidentStore
from .lean_build import held_bytes


class SplitStore:
    """Host slots [0, disk_count) in `disk` (a `state_store.NvmeStateStore`), the others in
    `memory` (a `cpu_offload.ResidentStore`), behind the stores' one interface. Host slots are
    numbered by bucket index, the reverse of the forward, so the disk ones come last in it."""

    def __init__(self, memory: ResidentStore, disk, disk_count: int):
        self.memory, self.disk, self.disk_count = memory, disk, disk_count

    def on_disk(self, i: int) -> bool:
        return i < self.disk_count

    def _where(self, i: int):
        return (self.disk, i) if i < self.disk_count else (self.memory, i - self.disk_count)

    def prefetch(self, i: int) -> None:
        store, j = self._where(i)
        store.prefetch(j)

    def acquire(self, i: int) -> dict:
        store, j = self._where(i)
        return store.acquire(j)

    def release(self, i: int, write: bool = True) -> None:
        store, j = self._where(i)
        store.release(j, write=write)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()


def local_ranks() -> int:
    """Ranks sharing this host (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_store(plan, slots: list, *, pin: bool, rank: int, grad_bytes: int,
               param_bytes: int, initial: dict | None, numel: int, scratch: float = 0.0):
    """(SplitStore, `HostSplit`) for the host slots `slots` (by bucket index) of an offload
    `plan` (config.offload.OffloadPlan); `numel`: the flat buffer's elements (what a saving
    run gathers); `scratch`: the host step's fp32 gradient scratch (`host_split`). A
    ValueError of one line, before anything is allocated, when the host or the disk cannot
    hold the split."""
    ranks = local_ranks()
    available = host_memory_bytes()
    if available is not None:
        available += held_bytes(initial)  # (the fill frees them)
    budget = None
    if plan.nvme_path is not None:
        budget = plan.host_memory
        if budget is None and available is not None:
            budget = split_budget(available / ranks, numel if plan.saves else 0)
    forward = [s.numel for s in reversed(slots)]
    split = host_split(forward, budget, grad_bytes=grad_bytes, param_bytes=param_bytes,
                       late_grads=not plan.delayed, scratch=scratch)
    limit = available
    if plan.host_memory is not None:
        limit = min(plan.host_memory * ranks, math.inf if available is None else available)
    disk_count = len(slots) - split.memory
    root = os.path.join(plan.nvme_path or "", f"rank{rank:05d}")
    free = None
    if split.disk:  # (a store's old files are allocated anew: their bytes count as free)
        from .state_store import reused_bytes

        free = check_nvme_path(plan.nvme_path) + reused_bytes(root, disk_count) * ranks
    check_offload_plan(split.host, split.disk, host_memory=limit, disk_memory=free,
                       nvme_path=plan.nvme_path, ranks_per_host=ranks)
    # split: state in memory and the disk's staging slots are pageable, only the host reads
    # them (host_split)
    memory = ResidentStore([s.numel for s in slots[disk_count:]], "cpu",
                           pin=pin and not split.pageable)
    disk = None
    if disk_count:
        from .state_store import NvmeStateStore

        disk = NvmeStateStore(root, [s.numel for s in slots[:disk_count]], pin=False)
    return SplitStore(memory, disk, disk_count), split


def describe(split, buckets: int, host: list, nvme_path: str | None) -> str:
    """One line: how many of `buckets` are on the host (`host`: their slots), the host bytes,
    and the disk share ("" without host slots)."""
    if not host:
        return ""
    numel = sum(s.numel for s in host)
    line = (f"optimizer offload: {len(host)} of {buckets} buckets ({numel:,} elements) on "
            f"the host, {gb_text(split.host)} GB of host memory")
    if len(host) > split.memory:
        line += (f"; the last {len(host) - split.memory} of the forward on disk under "
                 f"{nvme_path} ({gb_text(split.disk)} GB)")
    return line
