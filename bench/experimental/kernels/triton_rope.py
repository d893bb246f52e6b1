"""Triton rotary embedding (HF LLaMA rotate_half convention), forward and backward.

One program per (token s, batch b) and block of heads: it loads cos/sin for (s, b) once and
rotates every head of that block. ``x`` may be a strided view (e.g. q split off a fused QKV
output) as long as its last dim is contiguous; the output is contiguous.

| tensor | shape | notes |
|---|---|---|
| x, y | [S, B, H, D] | bf16 / fp16 / fp32, x.stride(-1) == 1 |
| cos, sin | [S, B or 1, D] | any float dtype, last dim contiguous (B == 1: broadcast) |

Forward, with halves ``x = [x1, x2]``, ``cos = [c1, c2]``, ``sin = [s1, s2]``:
``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``. Backward (its transpose):
``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(X, C, S, Y, B, H, sx_s, sx_b, sx_h, sc_s, sc_b, HALF: tl.constexpr,
                 BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of token (s, b); BACKWARD applies the transpose."""
    pid = tl.program_id(0).to(tl.int64)
    s, b = pid // B, pid % B
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask_d = d < HALF
    mask = (heads < H) & mask_d
    cs = s * sc_s + b * sc_b + d
    c1 = tl.load(C + cs, mask=mask_d, other=0.0).to(tl.float32)
    c2 = tl.load(C + cs + HALF, mask=mask_d, other=0.0).to(tl.float32)
    s1 = tl.load(S + cs, mask=mask_d, other=0.0).to(tl.float32)
    s2 = tl.load(S + cs + HALF, mask=mask_d, other=0.0).to(tl.float32)
    xs = X + s * sx_s + b * sx_b + heads.to(tl.int64) * sx_h + d
    x1 = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    ys = Y + pid * H * (2 * HALF) + heads * (2 * HALF) + d
    tl.store(ys, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(ys + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [S, B, H, D] (last dim contiguous), cos/sin [S, B or 1, D] -> y [S, B, H, D] contiguous."""
    s_len, batch, heads, dim = x.shape
    half = dim // 2
    y = torch.empty((s_len, batch, heads, dim), device=x.device, dtype=x.dtype)
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    sc_b = cos.stride(1) if cos.shape[1] > 1 else 0
    grid = (s_len * batch, triton.cdiv(heads, block_h))
    _rope_kernel[grid](x, cos, sin, y, batch, heads, x.stride(0), x.stride(1), x.stride(2),
                       cos.stride(0), sc_b, HALF=half, BACKWARD=backward, BLOCK_H=block_h,
                       BLOCK_D=block_d, num_warps=4)
    return y
