"""Triton fused amax + scale + FP8 cast (imported only where triton works; GPU tensors).

Computes `megazoo.kernels.fp8_cast.quantize_reference` in one or two kernels:

| function | input | outputs |
|---|---|---|
| quantize_rows   | t [R, C] (any strides) | q [R, C] or [C, R] fp8 row-major, inv [rows, 1] fp32 |
| quantize_tensor | t [R, C] | q (same), inv [] fp32 |
| quantize_tensor_both | t [R, C] | q [R, C] and q.t() [C, R], both row-major, inv [] fp32 |
| transpose_bytes | q [R, C] fp8 | q.t() [C, R] row-major |

Rowwise: rows of at most 8192 elements are read once (a program holds whole rows).
Longer rows, and the transposed cast, loop: each program owns BR rows of u (u = t, or
t.t() read through its strides, so the transpose costs no extra pass) and reads them
twice (amax, then scale and cast) in BC-column tiles. Tensorwise: a block-max kernel folds
into one float32 with `atomic_max` (values are non-negative, so float ordering is integer
ordering), then an elementwise cast kernel reads that amax on the GPU: no host
synchronisation; `quantize_tensor_both`'s cast kernel writes each tile twice, as it is and
transposed, so a tensor both backward GEMMs need in both layouts is read once.
`transpose_bytes` moves FP8 bytes in square tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BR, _BC = 32, 128
_BLOCK = 4096
_ONE_PASS_MAX = 8192
_TILE = 64


@triton.jit
def _rows_one_pass_kernel(U, Q, Inv, R, C, su0, TOP: tl.constexpr, EPS: tl.constexpr,
                          BR: tl.constexpr, BC: tl.constexpr):
    """`_rows_kernel` for C <= BC: whole rows stay in registers, read once."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    u = tl.load(U + rows[:, None] * su0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(u), axis=1)
    scale = tl.math.div_rn(tl.zeros([BR], dtype=tl.float32) + TOP, tl.maximum(amax, EPS))
    q = tl.minimum(tl.maximum(u * scale[:, None], -TOP), TOP)
    tl.store(Q + rows[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=m)
    tl.store(Inv + rows, tl.math.div_rn(tl.zeros([BR], dtype=tl.float32) + 1.0, scale),
             mask=rows < R)


@triton.jit
def _transpose_kernel(X, Y, R, C, T: tl.constexpr):
    """Y [C, R] = X [R, C].t(), one T x T tile per program (bytes, any 1-byte dtype)."""
    r = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
    c = tl.program_id(1).to(tl.int64) * T + tl.arange(0, T)
    m = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(X + r[:, None] * C + c[None, :], mask=m)
    mt = (c < C)[:, None] & (r < R)[None, :]
    tl.store(Y + c[:, None] * R + r[None, :], tl.trans(x), mask=mt)


@triton.jit
def _rows_kernel(U, Q, Inv, R, C, su0, su1, TOP: tl.constexpr, EPS: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr):
    """Q[r, :] = cast(clamp(U[r, :] * s_r)), s_r = TOP / max(max_c |U[r, c]|, EPS)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    amax = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        m = rmask[:, None] & (cols < C)[None, :]
        u = tl.load(U + rows[:, None] * su0 + cols[None, :] * su1, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(u.to(tl.float32)), axis=1))
    scale = tl.math.div_rn(tl.zeros([BR], dtype=tl.float32) + TOP, tl.maximum(amax, EPS))
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        m = rmask[:, None] & (cols < C)[None, :]
        u = tl.load(U + rows[:, None] * su0 + cols[None, :] * su1, mask=m, other=0.0)
        q = tl.minimum(tl.maximum(u.to(tl.float32) * scale[:, None], -TOP), TOP)
        tl.store(Q + rows[:, None] * C + cols[None, :], q.to(Q.dtype.element_ty), mask=m)
    tl.store(Inv + rows, tl.math.div_rn(tl.zeros([BR], dtype=tl.float32) + 1.0, scale),
             mask=rmask)


@triton.jit
def _amax_kernel(T, Amax, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(T + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.atomic_max(Amax, tl.max(tl.abs(x), axis=0))


@triton.jit
def _cast_kernel(T, Q, Amax, Inv, N, TOP: tl.constexpr, EPS: tl.constexpr,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    scale = tl.math.div_rn(TOP + tl.zeros([1], dtype=tl.float32),
                           tl.maximum(tl.load(Amax + tl.arange(0, 1)), EPS))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(T + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x * scale, -TOP), TOP)
    tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)
    if pid == 0:
        tl.store(Inv + tl.arange(0, 1), tl.math.div_rn(1.0 + tl.zeros([1], dtype=tl.float32),
                                                       scale))


@triton.jit
def _cast_both_kernel(T, Q, QT, Amax, Inv, R, C, TOP: tl.constexpr, EPS: tl.constexpr,
                      TILE: tl.constexpr):
    """Q [R, C] = cast(T * s) and QT [C, R] = its transpose, s = TOP / max(amax, EPS); one
    TILE x TILE tile per program."""
    scale = tl.max(tl.math.div_rn(TOP + tl.zeros([1], dtype=tl.float32),
                                  tl.maximum(tl.load(Amax + tl.arange(0, 1)), EPS)), axis=0)
    r = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    c = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    m = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(T + r[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x * scale, -TOP), TOP).to(Q.dtype.element_ty)
    tl.store(Q + r[:, None] * C + c[None, :], q, mask=m)
    mt = (c < C)[:, None] & (r < R)[None, :]
    tl.store(QT + c[:, None] * R + r[None, :], tl.trans(q), mask=mt)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(Inv + tl.arange(0, 1), tl.math.div_rn(1.0 + tl.zeros([1], dtype=tl.float32),
                                                       scale + tl.zeros([1], dtype=tl.float32)))


def quantize_rows(t: torch.Tensor, dtype: torch.dtype, top: float, eps: float,
                  transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    u = t.t() if transpose else t
    rows, cols = u.shape
    q = torch.empty(rows, cols, dtype=dtype, device=t.device)
    inv = torch.empty(rows, 1, dtype=torch.float32, device=t.device)
    if cols <= _ONE_PASS_MAX and u.stride(1) == 1:
        block = triton.next_power_of_2(cols)
        br = max(1, 8192 // block)
        _rows_one_pass_kernel[(triton.cdiv(rows, br),)](u, q, inv, rows, cols, u.stride(0),
                                                       TOP=top, EPS=eps, BR=br, BC=block,
                                                       num_warps=8)
        return q, inv
    _rows_kernel[(triton.cdiv(rows, _BR),)](u, q, inv, rows, cols, u.stride(0), u.stride(1),
                                           TOP=top, EPS=eps, BR=_BR, BC=_BC, num_warps=4)
    return q, inv


def _amax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |t| as a [1] float32 on t's device, an empty [1] for the cast to write 1 / scale
    into), t contiguous."""
    amax = torch.zeros(1, dtype=torch.float32, device=t.device)
    _amax_kernel[(triton.cdiv(t.numel(), _BLOCK),)](t, amax, t.numel(), BLOCK=_BLOCK,
                                                    num_warps=8)
    return amax, torch.empty(1, dtype=torch.float32, device=t.device)


def quantize_tensor(t: torch.Tensor, dtype: torch.dtype, top: float, eps: float,
                    transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.contiguous()
    n = t.numel()
    amax, inv = _amax(t)
    q = torch.empty(t.shape, dtype=dtype, device=t.device)
    _cast_kernel[(triton.cdiv(n, _BLOCK),)](t, q, amax, inv, n, TOP=top, EPS=eps, BLOCK=_BLOCK,
                                           num_warps=8)
    return (transpose_bytes(q) if transpose else q), inv.reshape(())


def quantize_tensor_both(t: torch.Tensor, dtype: torch.dtype, top: float,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensorwise cast of t [R, C] in both layouts: (q [R, C], q.t() [C, R] row-major, inv [])."""
    t = t.contiguous()
    rows, cols = t.shape
    amax, inv = _amax(t)
    q = torch.empty(rows, cols, dtype=dtype, device=t.device)
    qt = torch.empty(cols, rows, dtype=dtype, device=t.device)
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
    _cast_both_kernel[grid](t, q, qt, amax, inv, rows, cols, TOP=top, EPS=eps, TILE=_TILE,
                            num_warps=4)
    return q, qt, inv.reshape(())


def transpose_bytes(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] contiguous (1-byte dtype) -> q.t() as a contiguous [C, R] tensor."""
    rows, cols = q.shape
    out = torch.empty(cols, rows, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(rows, _TILE), triton.cdiv(cols, _TILE))
    _transpose_kernel[grid](q.contiguous().view(torch.uint8), out.view(torch.uint8), rows, cols,
                            T=_TILE, num_warps=4)
    return out
