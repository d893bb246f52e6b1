"""The local part of a GELU MLP with its elementwise work inside the GEMMs (Megatron's
`--bias-gelu-fusion`, done with cuBLASLt epilogues as Transformer Engine does).

    y = gelu_mlp(x, w1, b1, w2, b2)
    # = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

x [..., in] -> y [..., out] on one rank: w1 [ffn, in] and w2 [out, ffn] are this rank's
shards; the tensor-parallel collectives stay outside (`ParallelMLP`). Against the plain ops:
- forward: fc1's GEMM adds the bias and applies GELU in its epilogue, writing the
  pre-activation (kept for backward) and the activation (fc2's input) in one pass, where
  otherwise a second kernel reads the pre-activation back;
- backward: fc2's input-gradient GEMM multiplies by GELU's derivative in its epilogue (a
  whole read-and-write of [tokens, ffn] less); the weight gradients go through
  `wgrad.weight_grad`, into the main gradient where the owner fuses them.
Each cuBLASLt call falls back to the torch ops where it cannot run (`cublaslt.gemm` returns
False), so both paths compute the same function; they differ by rounding only, the
epilogues working on the GEMM's fp32 accumulator before it is rounded to bf16 / fp16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cublaslt import gemm
from .wgrad import weight_grad

#: Smallest [tokens, ffn] activation (elements, per rank) worth the fused path: below it the
#: GPU time saved is less than the host time its Python and ctypes launches cost.
MIN_ACTIVATION = 1 << 25


class _GeluMLP(torch.autograd.Function):
    """F.linear -> GELU (tanh) -> F.linear with the epilogues above."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        x2 = x.reshape(-1, x.shape[-1])
        pre = x2.new_empty(x2.shape[0], w1.shape[0])
        act = torch.empty_like(pre)
        epilogue = "gelu_aux" if b1 is None else "gelu_aux_bias"
        if not gemm(x2, w1, act, trans_b=True, epilogue=epilogue, bias=b1, aux=pre):
            pre = F.linear(x2, w1, b1)
            act = F.gelu(pre, approximate="tanh")
        ctx.save_for_backward(x2, w1, w2, pre, act)
        ctx.x_shape = x.shape
        return F.linear(act, w2, b2).view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w1, w2, pre, act = ctx.saved_tensors
        need_dx, _, need_db1, _, need_db2 = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dpre = torch.empty_like(pre)
        if not gemm(dy2, w2, dpre, epilogue="dgelu", aux=pre):
            dpre = torch.ops.aten.gelu_backward(dy2 @ w2, pre, approximate="tanh")
        dw2, db2 = weight_grad(w2, dy2, act, need_db2)
        dx = (dpre @ w1).view(ctx.x_shape) if need_dx else None
        dw1, db1 = weight_grad(w1, dpre, x2, need_db1)
        return dx, dw1, db1, dw2, db2


def fusable(x: torch.Tensor, w1: torch.Tensor, gathered: int = 1) -> bool:
    """Whether `gelu_mlp` should run for input x [..., in] and this rank's w1 [ffn, in]:
    CUDA, bf16 / fp16 input and weights, no autocast (its casts would not be mirrored), and
    an activation of at least MIN_ACTIVATION elements, x's tokens times `gathered` (the
    sequence-parallel all-gather before the GEMM) times ffn."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and w1.dtype == x.dtype
            and not torch.is_autocast_enabled("cuda")
            and x.numel() // max(x.shape[-1], 1) * gathered * w1.shape[0] >= MIN_ACTIVATION)


def gelu_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
             b2: torch.Tensor | None) -> torch.Tensor:
    """F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2), fused (module
    docstring)."""
    return _GeluMLP.apply(x, w1, b1, w2, b2)
