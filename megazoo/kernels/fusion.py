"""Pointwise chains fused by `torch.compile` on GPUs, run eagerly elsewhere.

A chain like RMSNorm (square, mean, rsqrt, two multiplies, casts), RoPE (two multiplies, a
negation, a concatenation, an add) or SwiGLU (silu, multiply) costs one memory round trip
per op in eager mode; compiled, forward and backward become one kernel each. CPU runs (and
the CPU tests) stay eager: the compiled and eager functions compute the same thing.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .norms import rms_norm_reference


def fused_on_gpu(fn):
    """Decorator: call `torch.compile(fn)` when the first argument is on a CUDA device."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:  # compiled lazily, once per process
            compiled = torch.compile(fn, dynamic=False)
        return compiled(*args)

    return wrapper


#: RMSNorm where the Triton kernel does not run: the kernels' reference (float32 inside, the
#: weight applied before the one rounding to x's dtype, as the Triton kernel does), compiled
#: on GPUs. Rounding the normalised x before the weight (as HF LLaMA does) would round twice,
#: and a compiled chain may skip that inner rounding: results would depend on the path.
rms_norm = fused_on_gpu(rms_norm_reference)


@fused_on_gpu
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate, up] (equal halves of the last dimension), taken
    whole so that the fused backward kernel writes both halves of one gradient (split outside,
    their gradients would be joined by a separate `cat`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the halves of the last dimension (HF LLaMA convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin (HF LLaMA's RoPE; cos, sin broadcastable to x)."""
    return x * cos + rotate_half(x) * sin


@fused_on_gpu
def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated by cos, sin (already broadcastable to them): `rope_rotate` of each."""
    return rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
