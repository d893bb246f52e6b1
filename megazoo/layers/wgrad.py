"""Gradient-accumulation fusion: a linear's weight gradient summed straight into its fp32
main gradient (Megatron's `--gradient-accumulation-fusion`).

The weight-gradient GEMM takes the main gradient as its accumulator (beta = 1; beta = 0 for
the first micro-batch of a step, so nothing needs zeroing), which saves a pass over the
weights per micro-batch and never rounds the sum to bf16: `torch.addmm(...,
out_dtype=float32)` for bf16 / fp16, plain `addmm` for fp32, cuBLASLt (`cublaslt`) for FP8.

The contract between a gradient owner (the plain engine's `GradBuffer`) and the linears, as
attributes of the weight:
- `main_grad`: the fp32 tensor shaped like the weight that receives the gradient;
- `fuse_wgrad`: set by the owner: linears accumulate into `main_grad`;
- `main_grad_fresh`: set by the owner at the start of each step; the first accumulation of
  the step overwrites `main_grad` and clears it;
- `grad_added_to_main_grad`: set here after each accumulation; the owner's
  post-accumulate-grad hook clears it and skips its own add.
Autograd still needs a gradient to call that hook (it counts micro-batches and launches the
bucket's reduction), so the backward returns an uninitialized tensor of the weight's shape,
which the hook drops. Only a weight used once per forward, with no tensor hook on its
gradient, may be fused (the owner picks them: `linear.fusable_weights`).

CPU (tests, the CPU run) has no mixed-dtype addmm: there the gradient is computed in the
weight's dtype and added, the same arithmetic as without fusion.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.cublaslt import fp8_gemm_accumulate


def fuses_wgrad(weight: torch.Tensor) -> bool:
    """Whether this weight's gradient goes straight into its `main_grad`."""
    return weight.requires_grad and getattr(weight, "fuse_wgrad", False)


def _target(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(main_grad, accumulate) for this call; marks the weight's gradient as delivered."""
    accumulate = not weight.main_grad_fresh
    weight.main_grad_fresh = False
    weight.grad_added_to_main_grad = True
    return weight.main_grad, accumulate


def _delivered(weight: torch.Tensor) -> torch.Tensor:
    """What backward returns for a fused weight: shaped like it, never read."""
    return torch.empty_like(weight)


def _store(main: torch.Tensor, grad: torch.Tensor, accumulate: bool) -> None:
    main.add_(grad) if accumulate else main.copy_(grad)


def add_to_main_grad(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The unfused arithmetic under the fused contract: `grad` copied or added."""
    main, accumulate = _target(weight)
    _store(main, grad, accumulate)
    return _delivered(weight)


def accumulate_wgrad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """main_grad (+)= dy^T x for dy [M, N], x [M, K] in the weight's dtype; returns what
    backward gives autograd for the weight."""
    if weight.device.type != "cuda":
        return add_to_main_grad(weight, dy.t() @ x)
    main, accumulate = _target(weight)
    beta = 1.0 if accumulate else 0.0
    if x.dtype == main.dtype:  # fp32, or a bf16 main gradient (--accumulate-grads-in-bf16)
        torch.addmm(main, dy.t(), x, beta=beta, out=main)
    else:
        torch.addmm(main, dy.t(), x, beta=beta, out_dtype=torch.float32, out=main)
    return _delivered(weight)


def weight_grad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor,
                want_db: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(what autograd gets for the weight, the bias gradient dy.sum(0) or None) for
    y = x W^T + b with dy [M, N], x [M, K]: fused into `main_grad` where the owner asked for
    it, else dy^T x."""
    if fuses_wgrad(weight):
        dw = accumulate_wgrad(weight, dy, x)
    else:
        dw = dy.t() @ x if weight.requires_grad else None
    return dw, dy.sum(0) if want_db else None


def accumulate_fp8_wgrad(weight: torch.Tensor, dyt: torch.Tensor, xt: torch.Tensor,
                         inv_dyt: torch.Tensor, inv_xt: torch.Tensor,
                         unfused: Callable[[], torch.Tensor]) -> torch.Tensor:
    """main_grad (+)= (dyt @ xt^T) * inv_dyt * inv_xt for FP8 dyt [N, M], xt [K, M]; where
    cuBLASLt cannot take it (rowwise scales, emulation, alignment), `unfused()` computes
    the gradient and it is added."""
    main, accumulate = _target(weight)
    if not fp8_gemm_accumulate(dyt, xt, inv_dyt, inv_xt, main, accumulate):
        _store(main, unfused(), accumulate)
    return _delivered(weight)


class _LinearIntoMainGrad(torch.autograd.Function):
    """F.linear whose backward accumulates dW into `weight.main_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, _, need_db = ctx.needs_input_grad
        dx = dy @ weight if need_dx else None
        dw, db = weight_grad(weight, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]),
                             need_db)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, with the weight gradient fused into `main_grad` where the owner asked for
    it (and not under autocast, whose casts the custom backward would not mirror)."""
    if (fuses_wgrad(weight) and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type)):
        return _LinearIntoMainGrad.apply(x, weight, bias)
    return F.linear(x, weight, bias)
