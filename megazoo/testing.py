"""Run a function on N spawned ranks (gloo on CPU, nccl on GPUs) with a hang timeout.

    results = run_distributed(check_something, 4, arg, timeout=120)

Each rank initialises torch.distributed through a file store (no port to race for), calls
`fn(*args)`, and sends back its return value. A rank that raises makes the call raise with
that rank's traceback; ranks that have not finished when the timeout expires are killed and
the call raises TimeoutError, so a hang fails a test instead of stalling CI.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _worker(fn, rank, world_size, store_path, backend, timeout, results, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Plain pickle by value: a shared-memory tensor would die with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # report anything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    backend: str = "gloo") -> list:
    """Run `fn(*args)` on `world_size` ranks; return the list of per-rank results."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, store, backend, timeout, results, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)


def _collect(procs, results, timeout: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(out))
            raise TimeoutError(f"ranks {missing} of {len(procs)} did not finish within "
                               f"{timeout:.0f} s (a hang, or a collective some ranks skipped)")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in out and p.exitcode not in (None, 0)]
            if dead:
                raise RankFailed(f"rank {dead[0]} died with exit code "
                                 f"{procs[dead[0]].exitcode} before reporting") from None
            continue
        if not ok:
            raise RankFailed(f"rank {rank} of {len(procs)} raised:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(len(procs))]
