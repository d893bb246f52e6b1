"""Where a run's host memory goes, phase by phase: `bench/plan_check.py` records the process's
resident set (VmRSS), its peak so far (VmHWM), and torch's pinned host allocator (the bytes
its blocks hold, each rounded up to a power of two) after the model's build, the engine's
start (DeepSpeed: partitioning, masters, pinned gradient buffers) and each training step.

    phases = []
    with recording(phases):          # wraps run.setup's build steps and the engine's step
        run = setup(args); train(run)
    phases -> [{"phase": "model_built", "rss_gb": .., "hwm_gb": .., "pinned_gb": ..}, ...]
"""
from __future__ import annotations

import contextlib

GB = 1e9


def host_snapshot(phase: str) -> dict:
    """VmRSS and VmHWM of this process (bytes / 1e9; Linux), and the pinned host allocator's
    reserved and allocated bytes when CUDA is up (None otherwise)."""
    row = {"phase": phase, "rss_gb": None, "hwm_gb": None, "pinned_gb": None,
           "pinned_allocated_gb": None}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    row[f"{key[2:].lower()}_gb"] = int(value.split()[0]) * 1024 / GB
    except OSError:
        pass
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if torch.cuda.is_available() and stats is not None:
        got = stats()
        reserved = got.get("reserved_bytes.current", got.get("segment.current"))
        allocated = got.get("allocated_bytes.current")
        row["pinned_gb"] = None if reserved is None else reserved / GB
        row["pinned_allocated_gb"] = None if allocated is None else allocated / GB
    return row


@contextlib.contextmanager
def recording(phases: list):
    """Within: `megazoo.training.run`'s model build and engine build, and every engine's
    `train_step`, append a `host_snapshot` to `phases` when they return."""
    from megazoo.training import run as run_module
    from megazoo.training.backends.base import Engine

    saved = run_module.build_run_model, run_module.build_engine, Engine.train_step
    phases.append(host_snapshot("start"))

    def after(name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            phases.append(host_snapshot(name))
            return out
        return wrapped

    run_module.build_run_model = after("model_built", saved[0])
    run_module.build_engine = after("engine_built", saved[1])
    Engine.train_step = after("step", saved[2])
    try:
        yield phases
    finally:
        run_module.build_run_model, run_module.build_engine, Engine.train_step = saved
        phases.append(host_snapshot("end"))
