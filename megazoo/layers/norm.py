"""Normalisation layers over the hidden dimension: `LayerNorm` and `RMSNorm`.

Both are replicated over tensor-parallel ranks. Under Megatron sequence parallelism each tp
rank normalises only its sequence shard, so its weight gradient is a partial sum: the
parameters are then tagged with `mark_sequence_parallel` and summed over tp before the step.

On CUDA (with Triton) both run the fused Triton kernels of `megazoo.kernels`, one kernel
forward and one backward. Elsewhere F.layer_norm and the RMSNorm of kernels/fusion.py (the
kernels' reference, compiled on GPUs) compute the same function; RMSNorm rounds the same way
on every path (float32 inside, one rounding to x's dtype after the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels.fusion import rms_norm
from .linear import mark_sequence_parallel


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim. x, y: [s, b, h]."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused_norm_runs(x):
            return kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim (no centring, no bias)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused_norm_runs(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def build_norm(kind: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
               device=None, dtype=None) -> nn.Module:
    """`kind` is "layernorm" or "rmsnorm"."""
    classes = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
    if kind not in classes:
        raise ValueError(f"norm must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind](hidden_size, eps, sequence_parallel=sequence_parallel,
                         device=device, dtype=dtype)
