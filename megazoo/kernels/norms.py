"""Fused LayerNorm and RMSNorm (what apex's fused norms give Megatron), with PyTorch fallbacks.

Function computed by every implementation, over the last dimension ``N`` of ``x [..., N]``
(any N: it need not be a multiple of 128), in float32, rounded once to ``x.dtype``:

* LayerNorm: ``y = (x - mean) / sqrt(var + eps) * weight + bias`` (biased variance);
* RMSNorm:   ``y = x / sqrt(mean(x^2) + eps) * weight`` (LLaMA's; HF rounds the
  normalised x to the input dtype before the weight, we round once at the end, as apex).

``weight``/``bias`` may be float32 while ``x`` is bf16/fp16 (mixed precision); their grads
come back in their own dtype. The Triton kernels (``triton_norms``) are used for CUDA
tensors whose rows fit one program (N <= 65536); the fallback is plain PyTorch.

Why Triton here: a norm is a row-wise reduction plus elementwise work, memory-bound; Triton
reaches hand-written CUDA speed for that with a fraction of the code, autotunes the warps
per row on each GPU, and compiles at run time, so no CUDA toolkit or ABI has to match torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _dispatch


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float = 1e-5) -> torch.Tensor:
    """PyTorch LayerNorm over the last dim, computed in float32 (float64 for float64 x), returned in x.dtype."""
    n, f = x.shape[-1], _dispatch.compute_dtype(x)
    y = F.layer_norm(x.to(f), (n,), weight.to(f), None if bias is None else bias.to(f), eps)
    return y.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PyTorch RMSNorm over the last dim, computed in float32 (float64 for float64 x), returned in x.dtype."""
    f = _dispatch.compute_dtype(x)
    xf = x.to(f)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(f)).to(x.dtype)


class _TritonNorm(torch.autograd.Function):
    """forward: y = norm(x) * w (+ b) by Triton; backward: dx, dw, db by Triton (+ a torch sum).

    x [..., N] -> x2d [M, N]; weight, bias [N]; saved: x2d, weight, mean [M], rstd [M].
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        kernels = _dispatch.triton_module("norms")
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, mean, rstd = kernels.norm_forward(x2d, weight.contiguous(),
                                             None if bias is None else bias.contiguous(), eps, rms)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.bias_dtype = rms, bias is not None, getattr(bias, "dtype", None)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        kernels = _dispatch.triton_module("norms")
        dy2d = dy.reshape(x2d.shape).contiguous()
        dx, dw, db = kernels.norm_backward(dy2d, x2d, weight.contiguous(), ctx.has_bias,
                                           mean, rstd, ctx.rms)
        db = None if db is None else db.to(ctx.bias_dtype)
        return dx.view(dy.shape), dw.to(weight.dtype), db, None, None


def unsupported(x: torch.Tensor) -> str | None:
    """Why the fused norm kernels cannot take x [..., N], or None if they can."""
    n = x.shape[-1]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} has no fused kernel"
    if n > 65536 or x.numel() == 0:
        return f"hidden size {n} or empty input outside the fused kernel's range (N <= 65536)"
    return None


def _pick(x: torch.Tensor, impl: str | None) -> str:
    """The implementation for a norm over x's last dimension."""
    return _dispatch.pick(x, impl, unsupported=unsupported(x))


def fused_norm_runs(x: torch.Tensor) -> bool:
    """True when layer_norm / rms_norm would run the Triton kernel on x (not the fallback)."""
    return x.is_cuda and _pick(x, None) == "triton"


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, impl: str | None = None) -> torch.Tensor:
    """LayerNorm of x [..., N] over N with weight, bias [N]; result in x.dtype.

    `impl`: None picks the best available ("triton" on a GPU, else "torch"); "triton" or
    "torch" forces one (RuntimeError saying why if it cannot run).
    """
    if _pick(x, impl) == "triton":
        return _TritonNorm.apply(x, weight, bias, eps, False)
    return layer_norm_reference(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             impl: str | None = None) -> torch.Tensor:
    """RMSNorm of x [..., N] over N with weight [N]; result in x.dtype. `impl` as layer_norm."""
    if _pick(x, impl) == "triton":
        return _TritonNorm.apply(x, weight, None, eps, True)
    return rms_norm_reference(x, weight, eps)
