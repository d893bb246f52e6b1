"""Dynamic FP8 scaling: amax, scale and cast of a 2-D tensor, fused where a GPU allows.

The definition (`quantize_reference`), for `t [R, C]` in any float dtype and an FP8 dtype
with largest finite value `fp8_max` (448 for e4m3fn, 57344 for e5m2):

    amax  = max |t|                    over the whole tensor (tensorwise: a 0-dim scale)
                                       or over each row      (rowwise: scales [R, 1])
    scale = fp8_max / max(amax, 1e-12)           float32; the guard keeps an all-zero
                                                 tensor (or row) finite: it casts to zeros
    q     = cast(clamp(t * scale, -fp8_max, fp8_max))   round to nearest even, in float32
    inv   = 1 / scale                            what `torch._scaled_mm` multiplies back

With `transpose=True` the same is computed for `t.t()` and `q` is written `[C, R]`
row-major: the backward GEMMs need the operands along the other axis (see `fp8.py`).

`quantize(..., impl=)` computes it as separate PyTorch ops (``"eager"``: the CPU emulation),
through ``torch.compile`` (``"compile"``) or with the kernels of ``triton_fp8``
(``"triton"``); ``"auto"`` is eager on CPU, else triton where it imports, else compile.
"""
from __future__ import annotations

import functools

import torch

from ._dispatch import triton_module, triton_status

CAST_IMPLS = ("auto", "triton", "compile", "eager")  # `quantize`'s impl= (and the config's)
EPS = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_reference(t: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                       transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (q [R, C] or [C, R] row-major in `dtype`, inv scale [rows, 1] or [])."""
    top = fp8_max(dtype)
    t = t.t() if transpose else t
    a = t.abs().float()
    amax = a.amax(dim=1, keepdim=True) if rowwise else a.amax()
    # a true division: `top / tensor` would be torch's reciprocal-then-multiply, which rounds
    # twice and differs from the kernels' correctly rounded division in about a quarter of cases
    scale = torch.full_like(amax, top) / amax.clamp(min=EPS)
    q = (t.float() * scale).clamp(-top, top).to(dtype).contiguous()
    return q, scale.reciprocal()


def _transpose_reference(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous()


@functools.lru_cache(maxsize=2)
def _compiled(fn):
    # dynamic=None: a second shape makes the sizes symbolic instead of recompiling per layer.
    return torch.compile(fn, dynamic=None)


@functools.lru_cache(maxsize=1)
def _triton_kernels():
    """The Triton kernels module, or None when triton does not import (no GPU stack)."""
    return triton_module("fp8") if triton_status()[0] else None


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation `impl` means for a tensor on `device` (see the module docstring)."""
    if impl not in CAST_IMPLS:
        raise ValueError(f"FP8 cast must be one of {CAST_IMPLS}, got {impl!r}")
    if device.type != "cuda":
        return "eager"
    if impl == "auto":
        return "triton" if _triton_kernels() is not None else "compile"
    if impl == "triton" and _triton_kernels() is None:
        raise RuntimeError("FP8 cast='triton' requested but triton does not import here; "
                           "use cast='compile' or 'auto'")
    return impl


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool, transpose: bool = False,
             impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_reference` computed by the implementation `impl` resolves to."""
    impl = resolve_impl(impl, t.device)
    if impl == "eager":
        return quantize_reference(t, dtype, rowwise, transpose)
    if impl == "compile":
        return _compiled(quantize_reference)(t, dtype, rowwise, transpose)
    kernels = _triton_kernels()
    return (kernels.quantize_rows(t, dtype, fp8_max(dtype), EPS, transpose) if rowwise
            else kernels.quantize_tensor(t, dtype, fp8_max(dtype), EPS, transpose))


def quantize_both(t: torch.Tensor, dtype: torch.dtype, impl: str = "auto"):
    """Tensorwise `quantize_reference(t)` in both layouts: (q [R, C], q.t() contiguous, inv).
    The Triton implementation writes both from one read of t."""
    impl = resolve_impl(impl, t.device)
    if impl == "triton":
        return _triton_kernels().quantize_tensor_both(t, dtype, fp8_max(dtype), EPS)
    q, inv = quantize(t, dtype, False, impl=impl)
    return q, transpose(q, impl), inv


def transpose(q: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """q [R, C] (FP8) -> q.t() contiguous [C, R], by the implementation `impl` resolves to."""
    impl = resolve_impl(impl, q.device)
    if impl == "eager":
        return _transpose_reference(q)
    if impl == "compile":
        return _compiled(_transpose_reference)(q)
    return _triton_kernels().transpose_bytes(q)
