"""Optimizer state on local disk, streamed through a few staging buffers (the disk tier).

    store = NvmeStateStore(root, numels=[shard.numel for shard in shards])
    for i in range(len(shards)):
        state = store.acquire(i)        # views into a staging slot, read from disk
        if i + 1 < len(shards):
            store.prefetch(i + 1)       # the next read runs while this shard steps
        step(state)                     # modify in place
        store.release(i)                # write-back starts; the slot is reused after it
    store.flush()                       # every write is on disk

Optimizer state larger than host memory lives on disk, `slots` shards in memory at a time.
Shard i is the file `shard{i:05d}.bin` under `root` (its tensors in `NAMES` order, padded
to 4 KiB), allocated anew as zeros by a new store (like state in memory); `root` is one
run's at a time and holds nothing else (`store_folder.claim_folder`). I/O: one `os.preadv` / `os.pwritev` of the whole shard on a thread pool (no GIL:
it overlaps the host optimizer step), O_DIRECT where the filesystem has it (`self.direct`).
A read into a slot waits for the slot's last write, a read of a shard for that shard's
pending write. A background I/O error is raised by the next call and every later one.
Call the methods from one thread at a time.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from itertools import count
from pathlib import Path

import torch

from ...offload.bytes import DISK_ALIGN, STORE_SLOTS
from .cpu_offload import NAMES
from .store_folder import claim_folder

# file sizes, I/O lengths and buffer addresses: a multiple of the block size (the planner
# counts the same padding and staging slots)
ALIGN = DISK_ALIGN


class StoreError(ValueError):
    """The disk store cannot be set up (path not writable, disk too small) or its I/O failed."""


@dataclass
class _Slot:
    buf: torch.Tensor            # flat uint8, bytes of the largest shard
    shard: int | None = None     # which shard's bytes it holds (or is reading / writing)
    held: bool = False           # acquired and not released
    future: Future | None = None  # its last read or write
    tick: int = 0                # last use, for choosing which slot to reuse


def shard_path(root: str | Path, i: int) -> Path:
    """Shard i's file under `root`."""
    return Path(root) / f"shard{i:05d}.bin"


def reused_bytes(root: str | Path, count: int) -> int:
    """Disk bytes the files of shards [0, count) already hold under `root` (a new store
    allocates them anew: they count as free)."""
    paths = [shard_path(root, i) for i in range(count)]
    return sum(p.stat().st_blocks * 512 for p in paths if p.exists())


def _transfer(call, fd: int, view: memoryview) -> None:
    """All of view from / to the file's start: `call` is os.preadv or os.pwritev."""
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], done)
        if n == 0:
            raise OSError(errno.EIO, f"{call.__name__} stopped at byte {done} of {len(view)}")
        done += n


_read_all = partial(_transfer, os.preadv)     # (fd, view): fill view from the file
_write_all = partial(_transfer, os.pwritev)   # (fd, view): view to the file


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's own bytes (no copy; CPU, contiguous)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def _aligned(nbytes: int, pin: bool = False) -> torch.Tensor:
    """nbytes of uint8 starting at a multiple of ALIGN (what O_DIRECT asks of a buffer)."""
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if raw.data_ptr() % ALIGN == 0:   # pinned memory is page aligned: no bytes to spare
        return raw
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes]


class NvmeStateStore:
    """Per-shard fp32 optimizer tensors (`NAMES`, each of numels[i] elements) in files under
    `root`. Slots are pinned (for asynchronous copies to the GPU) if `pin`, by default if CUDA
    is available; `threads` I/O threads, by default max(2, slots)."""

    def __init__(self, root: str | Path, numels: list[int], slots: int = STORE_SLOTS,
                 pin: bool | None = None, threads: int | None = None, direct: bool = True):
        self.root = Path(root)
        self.numels = [int(n) for n in numels]
        self.paths = [shard_path(self.root, i) for i in range(len(self.numels))]
        spans = [self._span(i) for i in range(len(self.numels))]
        self.nbytes = sum(spans)
        self._fds: list[int] = []
        self.direct = self._open_files(direct)
        pin = torch.cuda.is_available() if pin is None else pin
        self._slots = [_Slot(_aligned(max(spans), pin)) for _ in range(slots)]
        self._writes: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads or max(2, slots),
                                        thread_name_prefix="state-store")
        self._error, self._error_lock = None, threading.Lock()  # the first background failure
        self._ticks = count()

    def _span(self, i: int) -> int:   # bytes of shard i's file: its tensors, padded to ALIGN
        return -(-len(NAMES) * self.numels[i] * 4 // ALIGN) * ALIGN

    def _open_files(self, direct: bool) -> bool:
        """Claim root (`store_folder`) and create the shard files (StoreError if another run
        holds root, it holds files not the store's, or it is not writable or too small);
        O_DIRECT?"""
        try:
            claim_folder(self.root, StoreError)
        except OSError as exc:
            self._unwritable(exc)
        # The files are emptied and allocated anew: what they hold now comes back.
        needed = self.nbytes - sum(p.stat().st_blocks * 512 for p in self.paths if p.exists())
        free = shutil.disk_usage(self.root).free
        if needed > free:
            raise StoreError(f"disk store path {self.root} needs {needed} more bytes ("
                             f"{needed / 2**30:.2f} GiB), {free} bytes ({free / 2**30:.2f} GiB) "
                             "are free; choose a larger disk or keep less state on disk")
        direct, flags = direct and hasattr(os, "O_DIRECT"), os.O_RDWR | os.O_CREAT
        try:
            for i, path in enumerate(self.paths):
                try:
                    fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
                except OSError as exc:     # EINVAL: a filesystem without O_DIRECT (old tmpfs)
                    if not (direct and i == 0 and exc.errno == errno.EINVAL):
                        raise
                    direct, fd = False, os.open(path, flags, 0o644)
                self._fds.append(fd)
                self._allocate(fd, self._span(i))
        except OSError as exc:
            self._close_files()
            self._unwritable(exc)
        return direct

    def _unwritable(self, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError(f"disk store path {self.root}: cannot allocate {self.nbytes} "
                             f"bytes ({exc.strerror}); choose a larger disk") from None
        raise StoreError(f"disk store path {self.root} is not writable "
                         f"({exc.strerror or exc}); choose a writable directory") from None

    @staticmethod
    def _allocate(fd: int, size: int) -> None:
        """size bytes of zeros (fresh extents read as zeros: nothing is written)."""
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)   # reserve the blocks now, not at the first write
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it
                raise

    def _close_files(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def _submit(self, what: str, i: int, after: list[Future], io, *args) -> Future:
        def task():
            wait(after)
            try:
                io(*args)
            except Exception as exc:
                error = StoreError(f"disk store {self.paths[i]}: {what} failed: {exc}")
                error.__cause__ = exc
                with self._error_lock:
                    self._error = self._error or error
                raise
        return self._pool.submit(task)

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _find(self, i: int) -> _Slot | None:
        return next((s for s in self._slots if s.shard == i), None)

    def _take_slot(self) -> _Slot | None:
        """A slot to read into: a free one, else the least recently used one not held."""
        unheld = [s for s in self._slots if not s.held]
        return min(unheld, key=lambda s: (s.shard is not None, s.tick), default=None)

    def prefetch(self, i: int) -> None:
        """Start reading shard i into a slot (no-op if it is in one, or every slot is held)."""
        self._check(i)
        slot = self._find(i)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return
            after = [f for f in (slot.future, self._writes.get(i)) if f is not None]
            view = _bytes_of(slot.buf[:self._span(i)])
            slot.shard = i
            slot.future = self._submit("read", i, after, _read_all, self._fds[i], view)
        slot.tick = next(self._ticks)

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        """Shard i's tensors as views into its slot, once read (and any write-back done)."""
        self.prefetch(i)
        slot = self._find(i)
        if slot is None:
            raise RuntimeError(f"all {len(self._slots)} staging slots of the disk store are "
                               f"held; release a shard before acquiring shard {i}")
        if slot.held:
            raise RuntimeError(f"shard {i} of the disk store is already acquired")
        wait([slot.future])
        self._raise_failed()
        slot.held = True
        return self._views(i, slot.buf)

    def release(self, i: int, write: bool = True) -> None:
        """Give shard i back; its write-back starts now (write=False: unmodified, no write)."""
        self._check(i)
        slot = self._find(i)
        if slot is None or not slot.held:
            raise RuntimeError(f"shard {i} of the disk store is not acquired")
        slot.held = False
        slot.tick = next(self._ticks)
        if write:
            view = _bytes_of(slot.buf[:self._span(i)])
            slot.future = self._submit("write", i, [], _write_all, self._fds[i], view)
            self._writes[i] = slot.future

    def flush(self) -> None:
        """Wait for every pending read and write; raise a background I/O error if one failed."""
        wait([s.future for s in self._slots if s.future] + list(self._writes.values()))
        self._writes = {i: f for i, f in self._writes.items() if not f.done()}
        self._raise_failed()

    def _views(self, i: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.numels[i]
        flat = buf[:len(NAMES) * n * 4].view(torch.float32)
        return {name: flat[k * n:(k + 1) * n] for k, name in enumerate(NAMES)}

    def _check(self, i: int) -> None:
        """IndexError for a shard out of range; the store's failure."""
        if not 0 <= i < len(self.numels):
            raise IndexError(f"shard {i} out of range: the disk store has {len(self.numels)}")
        self._raise_failed()
