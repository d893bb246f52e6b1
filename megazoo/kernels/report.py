"""Which implementation each fused kernel uses here, and why (``python -m megazoo.kernels``).

On a GPU each kernel also runs once through Triton, forward and backward, on a small probe, so
that a kernel that fails to compile shows up here with its error's first line rather than in
training. On a CPU-only machine nothing is compiled or run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _dispatch, norms

#: kernel name -> (function, whether the probe passes the weight as a bias too)
KERNELS = {"layer_norm": (norms.layer_norm, True), "rms_norm": (norms.rms_norm, False)}


@dataclass(frozen=True)
class KernelStatus:
    """One row of the report."""

    kernel: str
    impl: str
    """What an automatic call runs: "triton" or "torch" (the PyTorch fallback)."""
    triton: str
    reason: str


def _try_triton(kernel: str, device: torch.device) -> str:
    """'ok' if the kernel runs through Triton forward + backward on a probe, else the error's
    first line."""
    fn, with_bias = KERNELS[kernel]
    x = torch.randn(8, 1000, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        fn(x, w, *([w] if with_bias else []), impl="triton").float().sum().backward()
        return "ok"
    except Exception as exc:  # report, do not raise: the table is a diagnosis
        return f"failed: {_dispatch.first_line(exc)}"


def kernel_report(device: str | torch.device | None = None) -> list[KernelStatus]:
    """One KernelStatus per kernel for `device` (default: the first CUDA GPU, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    triton_ok, triton_reason = _dispatch.triton_status()
    rows = []
    for kernel in KERNELS:
        triton_col = triton_reason if triton_ok else f"no: {triton_reason}"
        if device.type != "cuda":
            why = f"no CUDA GPU (device {device.type})"
            rows.append(KernelStatus(kernel, "torch", triton_col,
                                     why if triton_ok else f"{why}; {triton_reason}"))
            continue
        if triton_ok:
            triton_col = f"{triton_reason}: {_try_triton(kernel, device)}"
        probe = torch.empty(8, 1000, device=device, dtype=torch.bfloat16)
        choice = _dispatch.automatic(probe, unsupported=norms.unsupported(probe))[0]
        rows.append(KernelStatus(kernel, choice.impl, triton_col, choice.reason))
    return rows


def format_report(rows: list[KernelStatus]) -> str:
    """The report as an aligned text table."""
    header = ("kernel", "in use", "triton", "why")
    table = [header] + [(r.kernel, r.impl, r.triton, r.reason) for r in rows]
    widths = [max(len(row[k]) for row in table) for k in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
             for row in table]
    return "\n".join(lines)
