"""Triton scale + (ALiBi) + causal mask + softmax, forward and backward (imported lazily).

One program per score row ``(b, h, i)`` of ``scores [b, h, sq, sk]`` (contiguous), holding
the whole row (``BLOCK = next_pow2(sk)``). Masked keys are never loaded, so a causal
forward reads about half the scores; every output element is written (zeros where masked).

| tensor | shape | dtype |
|---|---|---|
| scores, probs, dprobs, dscores | [b, h, sq, sk] | bf16 / fp16 / fp32 |
| slopes | [h] | fp32 (ALiBi; unused without it) |
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Longest key row one program holds; longer rows use the PyTorch fallback.
MAX_SK = 16384
_WARP_CONFIGS = [triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)]


@triton.jit
def _softmax_fwd(X, Y, Slopes, scale, H, SQ, SK, HAS_ALIBI: tl.constexpr,
                 CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """y = softmax(scale * x + slope_h * j) over keys j <= i + sk - sq (all j if not causal)."""
    row = tl.program_id(0).to(tl.int64)
    i = row % SQ
    cols = tl.arange(0, BLOCK)
    inside = cols < SK
    keep = inside
    if CAUSAL:
        keep = keep & (cols <= i + SK - SQ)
    x = tl.load(X + row * SK + cols, mask=keep, other=0.0).to(tl.float32)
    z = x * scale
    if HAS_ALIBI:
        slope = tl.load(Slopes + (row // SQ) % H)
        z += slope * cols.to(tl.float32)
    z = tl.where(keep, z, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=0))
    e = tl.where(keep, e, 0.0)
    y = e / tl.sum(e, axis=0)
    tl.store(Y + row * SK + cols, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd(DY, Y, DX, scale, SK, BLOCK: tl.constexpr):
    """dx = scale * y * (dy - sum(dy * y)) on one row (masked keys have y = 0, so dx = 0)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < SK
    y = tl.load(Y + row * SK + cols, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * SK + cols, mask=inside, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(y * dy, axis=0))
    tl.store(DX + row * SK + cols, dx.to(DX.dtype.element_ty), mask=inside)


_softmax_fwd_tuned = triton.autotune(configs=_WARP_CONFIGS, key=["SK", "CAUSAL"])(_softmax_fwd)
_softmax_bwd_tuned = triton.autotune(configs=_WARP_CONFIGS, key=["SK"])(_softmax_bwd)


def softmax_forward(scores: torch.Tensor, scale: float, slopes: torch.Tensor | None,
                    causal: bool) -> torch.Tensor:
    """scores [b, h, sq, sk] contiguous -> probs of the same shape and dtype."""
    b, h, sq, sk = scores.shape
    y = torch.empty_like(scores)
    kernel = _softmax_fwd_tuned if scores.is_cuda else _softmax_fwd
    s = scores if slopes is None else slopes  # an unused pointer without ALiBi
    kernel[(b * h * sq,)](scores, y, s, scale, h, sq, sk, HAS_ALIBI=slopes is not None,
                          CAUSAL=causal, BLOCK=triton.next_power_of_2(sk))
    return y


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Gradient of the scores from dprobs and probs, both [b, h, sq, sk] contiguous."""
    sk = y.shape[-1]
    dx = torch.empty_like(y)
    kernel = _softmax_bwd_tuned if y.is_cuda else _softmax_bwd
    kernel[(y.numel() // sk,)](dy, y, dx, scale, sk, BLOCK=triton.next_power_of_2(sk))
    return dx
