"""Shared GPU benchmark helpers: timing with CUDA events, the measured matmul ceiling, FLOPs.

Conventions (../shared/BENCHMARKS.md): warm up, then take the median of several timed steps;
random data, never zeros; MFU against the bf16 matmul ceiling measured in the same run.
"""
from __future__ import annotations

import json
import statistics

import torch


def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn()` over `iters` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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


def write_json(path: str | None, rows) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
