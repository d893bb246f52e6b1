"""Which implementation each fused kernel uses on this machine, and why (``python -m megazoo.kernels``).

For each kernel the report builds a small probe input on the device, asks the dispatcher
what an automatic call would run, and (on a GPU) runs it once forward and backward so that
a kernel that fails to compile shows up here with its error's first line rather than in
training. On a CPU-only machine nothing is compiled or run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _dispatch, norms


@dataclass(frozen=True)
class KernelStatus:
    """One row of the report."""

    kernel: str
    impl: str
    """What an automatic call runs: "triton" or "torch" (the PyTorch fallback)."""
    triton: str
    reason: str


def _probes(device: torch.device, dtype: torch.dtype) -> dict:
    """kernel name -> (call(impl) running forward + backward, unsupported reason)."""
    def run(fn):
        out = fn()
        out.float().sum().backward()
        return out

    x = torch.randn(8, 1000, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(1000, device=device, dtype=dtype, requires_grad=True)
    return {
        "layer_norm": (lambda i: run(lambda: norms.layer_norm(x, w, w, impl=i)),
                       norms.unsupported(x)),
        "rms_norm": (lambda i: run(lambda: norms.rms_norm(x, w, impl=i)), norms.unsupported(x)),
    }


def _try(call, impl: str) -> str:
    """'ok' if impl runs forward + backward on the probe, else the error's first line."""
    try:
        call(impl)
        return "ok"
    except Exception as exc:  # report, do not raise: the table is a diagnosis
        return f"failed: {_dispatch.first_line(exc)}"


def _status_of(name: str, call, unsupported, device: torch.device) -> KernelStatus:
    """The report row of one kernel on `device`."""
    triton_ok, triton_reason = _dispatch.triton_status()
    triton_col = triton_reason if triton_ok else f"no: {triton_reason}"
    if device.type != "cuda":
        why = f"no CUDA GPU (device {device.type})"
        if not triton_ok:
            why += f"; {triton_reason}"
        return KernelStatus(name, "torch", triton_col, why)
    if triton_ok:
        triton_col = f"{triton_reason}: {_try(call, 'triton')}"
    probe = torch.empty(1, device=device)
    choice = _dispatch.automatic(probe, unsupported=unsupported)[0]
    return KernelStatus(name, choice.impl, triton_col, choice.reason)


def kernel_report(device: str | torch.device | None = None) -> list[KernelStatus]:
    """One KernelStatus per kernel for `device` (default: the first CUDA GPU, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name, (call, unsupported) in _probes(device, dtype).items():
        rows.append(_status_of(name, call, unsupported, device))
    return rows


def format_report(rows: list[KernelStatus]) -> str:
    """The report as an aligned text table."""
    header = ("kernel", "in use", "triton", "why")
    table = [header] + [(r.kernel, r.impl, r.triton, r.reason) for r in rows]
    widths = [max(len(row[k]) for row in table) for k in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
             for row in table]
    return "\n".join(lines)
