"""The disk tier's state store: exact round trips, write-back ordering, errors named up front.

Every comparison is bitwise (torch.equal): the store only moves bytes, so nothing may change.
"""
from __future__ import annotations

import errno
import os
import random
import time
from collections import namedtuple

import pytest
import torch

from megazoo.training.backends import state_store
from megazoo.training.backends.state_store import NvmeStateStore, StoreError
from megazoo.training.backends.store_folder import LOCK

NAMES = ("master", "exp_avg", "exp_avg_sq")


def _random_shard(numel: int, gen: torch.Generator) -> dict:
    return {name: torch.randn(numel, generator=gen) for name in NAMES}


def _assert_shard(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _write(store, i: int, shard: dict) -> None:
    """Shard i's tensors replaced by `shard` (written back on release)."""
    for name, t in store.acquire(i).items():
        t.copy_(shard[name])
    store.release(i)


def _read(store, i: int) -> dict:
    """Shard i's tensors as the store holds them, in fresh CPU tensors."""
    out = {name: t.clone() for name, t in store.acquire(i).items()}
    store.release(i, write=False)
    return out


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_io(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *mode):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)
    monkeypatch.setattr(state_store.os, "open", no_direct)
    shard = _random_shard(5000, torch.Generator().manual_seed(6))
    store = NvmeStateStore(tmp_path, [100, 5000], pin=False)
    assert not store.direct
    _write(store, 1, shard)
    _assert_shard(store.acquire(1), shard)


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_is_bitwise_and_the_files_hold_it(tmp_path, direct):
    """O_DIRECT (where tmp_path's filesystem has it) and buffered; sizes not a block multiple.
    The flushed files hold each shard's tensors one after the other; a new store on the same
    root starts from zeros."""
    numels = [1000, 17, 4096, 1]
    gen = torch.Generator().manual_seed(0)
    ref = [_random_shard(n, gen) for n in numels]
    store = NvmeStateStore(tmp_path, numels, pin=False, direct=direct)
    assert store.direct in ((True, False) if direct else (False,))
    for i, shard in enumerate(ref):
        _assert_shard(store.acquire(i), {k: torch.zeros(numels[i]) for k in NAMES})
        store.release(i, write=False)
        _write(store, i, shard)
    for i, shard in enumerate(ref):
        _assert_shard(_read(store, i), shard)
        _assert_shard(store.acquire(i), shard)
        store.release(i, write=False)
    store.flush()
    assert sorted(os.listdir(tmp_path)) == [LOCK] + [f"shard{i:05d}.bin" for i in range(4)]
    for i, n in enumerate(numels):
        raw = (tmp_path / f"shard{i:05d}.bin").read_bytes()
        assert len(raw) % 4096 == 0
        flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)[:3 * n]
        _assert_shard(dict(zip(NAMES, flat.split(n))), ref[i])
    store = NvmeStateStore(tmp_path, numels, pin=False)
    for i, n in enumerate(numels):
        _assert_shard(_read(store, i), {k: torch.zeros(n) for k in NAMES})


def _slow_writes(monkeypatch, seconds: float) -> None:
    """Writes that take a while, so a read that did not wait for one would read stale bytes."""
    write = state_store._write_all

    def slow(fd, view):
        time.sleep(seconds)
        write(fd, view)
    monkeypatch.setattr(state_store, "_write_all", slow)


@pytest.fixture
def slow_writes(monkeypatch):
    _slow_writes(monkeypatch, 0.005)


def _stream(store, ref, order, gen, rng=None):
    """acquire / add noise / release over `order`, prefetching the next shard; ref follows.
    With `rng`, a read of a random shard after each release (it takes a slot: maybe the
    prefetched one, or one whose write is pending)."""
    store.prefetch(order[0])
    for pos, i in enumerate(order):
        state = store.acquire(i)
        _assert_shard(state, ref[i])
        if pos + 1 < len(order) and order[pos + 1] != i:
            store.prefetch(order[pos + 1])
        for name in NAMES:
            state[name].add_(torch.randn(state[name].shape, generator=gen))
            ref[i][name] = state[name].clone()
        store.release(i)
        if rng is not None:
            j = rng.randrange(len(ref))
            _assert_shard(_read(store, j), ref[j])


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_streaming_more_shards_than_slots_keeps_every_latest_value(tmp_path, slots,
                                                                  slow_writes):
    numels = [300, 1200, 50, 800, 700, 64]
    gen = torch.Generator().manual_seed(1)
    ref = [_random_shard(n, gen) for n in numels]
    rng = random.Random(slots)
    store = NvmeStateStore(tmp_path, numels, slots=slots, pin=False, threads=4)
    for i, shard in enumerate(ref):
        _write(store, i, shard)
    for _ in range(4):                                    # four "optimizer steps"
        _stream(store, ref, list(range(len(numels))), gen)
    _stream(store, ref, [rng.randrange(len(numels)) for _ in range(40)], gen)
    _stream(store, ref, [rng.randrange(len(numels)) for _ in range(40)], gen, rng)
    store.flush()
    for i in range(len(numels)):
        _assert_shard(_read(store, i), ref[i])


def test_release_then_reacquire_sees_the_last_write(tmp_path, slow_writes):
    """Same shard back at once, and after its slot was reused while the write was pending."""
    gen = torch.Generator().manual_seed(2)
    ref = [_random_shard(n, gen) for n in (256, 512, 128)]
    store = NvmeStateStore(tmp_path, [256, 512, 128], slots=2, pin=False)
    for i, shard in enumerate(ref):
        _write(store, i, shard)
    for value in range(1, 6):
        state = store.acquire(0)
        _assert_shard(state, ref[0])
        state["master"].fill_(float(value))
        ref[0]["master"] = state["master"].clone()
        store.release(0)
    for step in range(3):                 # shard 0's slot is taken over by 1 and 2
        for i in (0, 1, 2):
            state = store.acquire(i)
            _assert_shard(state, ref[i])
            state["exp_avg"].mul_(-1.5).add_(step)
            ref[i]["exp_avg"] = state["exp_avg"].clone()
            store.release(i)
    store.flush()
    for i in range(3):
        _assert_shard(_read(store, i), ref[i])


def test_a_read_waits_for_the_shards_write_pending_in_another_slot(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    ref = [_random_shard(n, gen) for n in (64, 32, 16)]
    # 4 threads: a queue of 2 would hide a missing wait behind the pool's FIFO order.
    store = NvmeStateStore(tmp_path, [64, 32, 16], slots=2, pin=False, threads=4)
    for i, shard in enumerate(ref):
        _write(store, i, shard)
    _slow_writes(monkeypatch, 0.2)
    store.acquire(0)["exp_avg_sq"].fill_(7.0)
    ref[0]["exp_avg_sq"].fill_(7.0)
    store.release(0)                        # slot X: writing shard 0 (slowly)
    store.acquire(2)
    store.release(2, write=False)           # slot Y: shard 2, used last
    store.prefetch(1)                       # takes X, after shard 0's write
    _assert_shard(store.acquire(0), ref[0])  # read into Y: must wait for that write too


def test_misuse_is_named(tmp_path):
    store = NvmeStateStore(tmp_path, [100, 200], slots=1, pin=False)
    store.acquire(0)
    with pytest.raises(RuntimeError, match="all 1 staging slots"):
        store.acquire(1)
    with pytest.raises(RuntimeError, match="already acquired"):
        store.acquire(0)
    store.release(0)
    with pytest.raises(RuntimeError, match="not acquired"):
        store.release(0)
    with pytest.raises(IndexError, match="has 2"):
        store.prefetch(2)


def test_unwritable_root_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as err:        # under a regular file: fails even for root
        NvmeStateStore(blocker / "x", [10], pin=False)
    assert "not writable" in str(err.value) and str(blocker / "x") in str(err.value)
    assert "\n" not in str(err.value)
    if os.geteuid() != 0:                         # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(StoreError, match="not writable"):
            NvmeStateStore(locked, [10], pin=False)


def _free_bytes(monkeypatch, free: int) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(state_store.shutil, "disk_usage", lambda path: usage(10**9, 0, free))


def test_too_little_disk_names_bytes_needed_and_free(tmp_path, monkeypatch):
    _free_bytes(monkeypatch, 4000)
    with pytest.raises(StoreError) as err:   # 3 x 1024 fp32 = 12288 bytes (3 blocks) a shard
        NvmeStateStore(tmp_path, [1024, 1024], pin=False)
    msg = str(err.value)
    assert str(tmp_path) in msg and "24576" in msg and "4000" in msg and "\n" not in msg
    assert not any(tmp_path.glob("shard*"))
    # The blocks the old files hold come back when a new store empties them.
    _free_bytes(monkeypatch, 12288)
    NvmeStateStore(tmp_path, [1024], pin=False)
    held = sum(p.stat().st_blocks * 512 for p in tmp_path.glob("shard*"))
    _free_bytes(monkeypatch, 24576 - held)
    NvmeStateStore(tmp_path, [1024, 1024], pin=False)
    held = sum(p.stat().st_blocks * 512 for p in tmp_path.glob("shard*"))
    _free_bytes(monkeypatch, 36864 - held - 1)
    with pytest.raises(StoreError, match=f"needs {36864 - held} more bytes"):
        NvmeStateStore(tmp_path, [1024, 1024, 1024], pin=False)


def _broken(fd, view):
    raise OSError(errno.EIO, "Input/output error")


def test_background_write_error_surfaces_at_flush_and_after(tmp_path, monkeypatch):
    store = NvmeStateStore(tmp_path, [64, 64], pin=False)
    store.acquire(0)
    monkeypatch.setattr(state_store, "_write_all", _broken)
    store.release(0)
    failed = r"shard00000.bin: write failed: \[Errno 5\] Input/output error"
    with pytest.raises(StoreError, match=failed) as err:
        store.flush()
    assert isinstance(err.value.__cause__, OSError)
    for call in (lambda: store.acquire(1), store.flush):
        with pytest.raises(StoreError, match=failed):
            call()


def test_background_read_error_surfaces_at_acquire(tmp_path, monkeypatch):
    store = NvmeStateStore(tmp_path, [64, 64], pin=False)
    monkeypatch.setattr(state_store, "_read_all", _broken)
    store.prefetch(1)
    with pytest.raises(StoreError, match=r"shard00001.bin: read failed: .*Input/output"):
        store.acquire(1)
    monkeypatch.undo()
    with pytest.raises(StoreError, match="shard00001.bin: read failed"):
        store.acquire(0)        # the store stays failed
    with pytest.raises(StoreError, match="read failed"):
        store.flush()


def test_a_second_process_cannot_take_a_folder_in_use(tmp_path):
    """Two runs given one --nvme-path would overwrite each other's state: while one process
    holds the folder, another's store is refused with one line; once it exits, it is free."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from megazoo.training.backends.state_store import NvmeStateStore\n"
         f"NvmeStateStore({str(tmp_path)!r}, [64], pin=False)\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreError, match="in use by another run") as err:
            NvmeStateStore(tmp_path, [64], pin=False)
        assert "\n" not in str(err.value) and "--nvme-path" in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    NvmeStateStore(tmp_path, [64], pin=False)  # the lock went with the process


def test_files_the_store_did_not_make_are_refused_untouched(tmp_path):
    """A user's file named like a shard, or beside the store's own, is never truncated."""
    mine = tmp_path / "a" / "shard00000.bin"
    mine.parent.mkdir()
    mine.write_bytes(b"a user's data")
    with pytest.raises(StoreError, match=r"did not make \(shard00000.bin\)"):
        NvmeStateStore(mine.parent, [64], pin=False)
    assert mine.read_bytes() == b"a user's data"
    ours = tmp_path / "b"
    NvmeStateStore(ours, [64], pin=False)
    (ours / "notes.txt").write_text("x")
    from megazoo.training.backends import store_folder

    store_folder._HELD.clear()  # (as a new process would start)
    with pytest.raises(StoreError, match=r"did not make \(notes.txt\)"):
        NvmeStateStore(ours, [64], pin=False)
