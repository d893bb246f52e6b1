"""Shared helpers of the benchmarks: timing (CUDA events on GPUs), tables, JSON output.

Run from the repository root (`python bench/x.py` puts bench/ first on the path; the repo
itself must be importable: `PYTHONPATH=$PWD` or an editable install).
"""
from __future__ import annotations

import json
import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of `fn()` in milliseconds, after `warmup` untimed calls.

    On CUDA each call is bracketed by CUDA events (no host overhead between launches is
    hidden); elsewhere by perf_counter around a synchronised call.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A fixed-width table of `rows` (dicts), one column per key in `columns`."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
