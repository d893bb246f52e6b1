"""Shared helpers of the benchmarks: timing (CUDA events on GPUs), the measured matmul
ceiling, model FLOPs, tables, JSON output.

Conventions (../shared/BENCHMARKS.md): warm up, then take the median of several timed steps;
random data, never zeros; MFU against the bf16 matmul ceiling measured in the same run.

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


def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn()` on the current CUDA device (see `time_ms`)."""
    return time_ms(fn, torch.device("cuda"), warmup, iters) / 1e3


def matmul_ceiling_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured TFLOP/s of an n^3 matmul on random data: the MFU denominator."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    seconds = time_cuda(lambda: a @ b, warmup=5, iters=20)
    return 2 * n**3 / seconds / 1e12


def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one training step (Megatron convention, no recompute, full s^2 attention)."""
    return (72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden))
            + 6 * batch * seq * hidden * vocab)


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


def write_json(path: str | None, payload) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
