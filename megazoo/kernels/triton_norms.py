"""Triton LayerNorm and RMSNorm, forward and backward (imported only where triton works).

Rows of ``x2d [M, N]`` are normalised over ``N`` in float32; one program holds a whole row
(``BLOCK_N = next_pow2(N)``, masked, so any N works: 1000, 1539, ...). Forward saves the
per-row ``mean`` (LayerNorm) and ``rstd`` in float32, as apex's fused norms do.

Backward runs ``P = M / R`` programs (about 8 per multiprocessor, ``R`` a power of two up
to 64); program ``p`` walks rows ``p*R .. p*R+R-1``, writes ``dx`` for each, and accumulates its partial ``dw``
(and ``db``) in registers, stored once to ``[P, N]`` float32 buffers that torch sums over
``P``. This keeps the weight-gradient reduction free of atomics and deterministic.

| tensor | shape | dtype |
|---|---|---|
| x2d, y, dy, dx | [M, N] | bf16 / fp16 / fp32, rows contiguous |
| weight, bias, dw, db | [N] | any float dtype (math in fp32) |
| mean, rstd | [M] | fp32 |
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_WARP_CONFIGS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]


@triton.jit
def _norm_fwd(X, W, B, Y, Mean, Rstd, N, eps, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """One row: y = (x - mean) * rstd * w + b (LayerNorm) or x * rstd * w (RMSNorm)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(Mean + row, mean)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(Rstd + row, rstd)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, W, DY, DX, Mean, Rstd, DW, DB, M, N, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx for rows [p*ROWS, p*ROWS+ROWS) and this program's partial dw, db (fp32, row p)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = pid.to(tl.int64) * ROWS  # int64: row * N may pass 2^31
    for k in range(ROWS):  # a constexpr trip count: a plain loop, also in the interpreter
        row = start + k
        m = cols < tl.where(row < M, N, 0)  # the row's columns, none past the last row
        x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=m, other=0.0).to(tl.float32)
        last = tl.minimum(row, M - 1)  # rows past M: x = dy = 0, so any finite rstd will do
        rstd = tl.load(Rstd + last)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(m, (x - tl.load(Mean + last)) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid.to(tl.int64) * N + cols, db, mask=mask)


_norm_fwd_tuned = triton.autotune(configs=_WARP_CONFIGS, key=["N", "RMS", "HAS_BIAS"])(_norm_fwd)
_norm_bwd_tuned = triton.autotune(configs=_WARP_CONFIGS, key=["N", "RMS", "HAS_BIAS", "ROWS"])(_norm_bwd)
#: (kernel, its autotuning key, dtypes, device) -> the launch options the autotuner chose.
_CHOSEN: dict[tuple, dict] = {}


def _launch(tuned, plain, grid, key: tuple, *args, **kwargs) -> None:
    """Launch a norm kernel on CUDA with the configuration the autotuner chose for `key`
    (tuning on the first call). Later calls launch the plain kernel with those options:
    the autotuner's own per-call bookkeeping costs the host about as much as the launch,
    and a model runs four norm kernels per layer and micro-batch."""
    options = _CHOSEN.get(key)
    if options is None:
        tuned[grid](*args, **kwargs)
        _CHOSEN[key] = tuned.best_config.all_kwargs()
    else:
        plain[grid](*args, **kwargs, **options)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows_per_program(x: torch.Tensor, rows: int) -> int:
    """Backward rows per program, a power of two (few compiled variants): on a GPU about
    8 programs per multiprocessor, at most 64 rows each; 4 programs under the interpreter."""
    programs = 8 * _multiprocessors(x.device) if x.is_cuda else 4
    return min(64, triton.next_power_of_2(triton.cdiv(rows, programs)))


def norm_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2d [M, N] contiguous -> (y [M, N], mean [M] fp32 (empty for RMS), rstd [M] fp32)."""
    m, n = x2d.shape
    y = torch.empty_like(x2d)
    mean = torch.empty(0 if rms else m, device=x2d.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x2d.device, dtype=torch.float32)
    block = triton.next_power_of_2(n)
    b = weight if bias is None else bias  # an unused pointer when HAS_BIAS is False
    args = (x2d, weight, b, y, mean, rstd, n, eps)
    meta = dict(HAS_BIAS=bias is not None, RMS=rms, BLOCK_N=block)
    if x2d.is_cuda:
        key = ("fwd", n, rms, bias is not None, x2d.dtype, weight.dtype, b.dtype, x2d.device)
        _launch(_norm_fwd_tuned, _norm_fwd, (m,), key, *args, **meta)
    else:
        _norm_fwd[(m,)](*args, **meta)
    return y, mean, rstd


def norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                  has_bias: bool, mean: torch.Tensor, rstd: torch.Tensor, rms: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx [M, N] in x's dtype, dw [N] fp32, db [N] fp32 or None)."""
    m, n = x2d.shape
    dx = torch.empty_like(x2d)
    rows_per_program = _rows_per_program(x2d, m)
    programs = triton.cdiv(m, rows_per_program)
    dw = torch.empty(programs, n, device=x2d.device, dtype=torch.float32)
    db = torch.empty(programs if has_bias else 0, n, device=x2d.device, dtype=torch.float32)
    args = (x2d, weight, dy2d, dx, mean, rstd, dw, db, m, n)
    meta = dict(HAS_BIAS=has_bias, RMS=rms, ROWS=rows_per_program,
                BLOCK_N=triton.next_power_of_2(n))
    if x2d.is_cuda:
        key = ("bwd", n, rms, has_bias, rows_per_program, x2d.dtype, weight.dtype, dy2d.dtype,
               x2d.device)
        _launch(_norm_bwd_tuned, _norm_bwd, (programs,), key, *args, **meta)
    else:
        _norm_bwd[(programs,)](*args, **meta)
    return dx, dw.sum(0), (db.sum(0) if has_bias else None)
