"""Triton fused bias + GeLU, forward and backward (imported only where triton works).

Elementwise over the flattened ``x [M, N]`` (contiguous); ``bias [N]`` is indexed by
``offset % N``, so any N works. Math in float32; ``tanh`` is written with ``exp`` (core
``triton.language`` only, no overflow) so the code runs on every Triton version.

| tensor | shape | dtype |
|---|---|---|
| x, y, dy, dx | [M, N] | bf16 / fp16 / fp32 |
| bias | [N] | x's dtype |
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((1024, 4), (2048, 8), (4096, 8))]
_DEFAULT_BLOCK = 1024  # under the interpreter (no autotuning on CPU)


@triton.jit
def _tanh(a):
    """tanh(a) = sign(a) (1 - e) / (1 + e) with e = exp(-2|a|) in (0, 1]: never overflows."""
    e = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a >= 0, t, -t)


@triton.jit
def _gelu_and_grad(u, TANH: tl.constexpr):
    """(gelu(u), d gelu / du) in float32; TANH picks the tanh approximation, else erf."""
    if TANH:
        k = 0.7978845608028654  # sqrt(2 / pi)
        t = _tanh(k * (u + 0.044715 * u * u * u))
        y = 0.5 * u * (1.0 + t)
        g = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * u * u)
    else:
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))
        y = u * cdf
        g = cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)
    return y, g


@triton.jit
def _bias_gelu_kernel(X, Bias, DY, Out, numel, N, TANH: tl.constexpr, BACKWARD: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Forward: out = gelu(x + b). Backward: out = dy * gelu'(x + b)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    u = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    u += tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    y, g = _gelu_and_grad(u, TANH)
    if BACKWARD:
        y = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32) * g
    tl.store(Out + offs, y.to(Out.dtype.element_ty), mask=mask)


_bias_gelu_tuned = triton.autotune(configs=_CONFIGS, key=["N"])(_bias_gelu_kernel)


def _launch(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor | None, tanh: bool) -> torch.Tensor:
    """Run the kernel on contiguous x [..., N], bias [N] (same dtype); returns y or dx."""
    out = torch.empty_like(x)
    numel, n = x.numel(), bias.numel()
    d = x if dy is None else dy  # an unused pointer in the forward
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(numel, meta["BLOCK"]),)  # noqa: E731
        _bias_gelu_tuned[grid](x, bias, d, out, numel, n, TANH=tanh, BACKWARD=dy is not None)
    else:
        grid = (triton.cdiv(numel, _DEFAULT_BLOCK),)
        _bias_gelu_kernel[grid](x, bias, d, out, numel, n, TANH=tanh, BACKWARD=dy is not None,
                                BLOCK=_DEFAULT_BLOCK)
    return out


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    """gelu(x + bias) for contiguous x [..., N], bias [N] of x's dtype."""
    return _launch(x, bias, None, tanh)


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    """dx = dy * gelu'(x + bias) (the bias gradient is dx summed over rows, done by torch)."""
    return _launch(x, bias, dy, tanh)
