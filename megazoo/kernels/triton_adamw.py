"""AdamW over a flat fp32 state on the GPU in one pass, the gradient as it is accumulated
(bf16 or fp32) and the new bf16 (or fp16) parameters written in the same pass (imported only
where triton works).

The offloaded optimizer's GPU share used to run three kernels per bucket: upcast the bf16
gradient to an fp32 scratch, torch's fused AdamW, cast the masters into the parameter
buffer (40 bytes moved per element); this one moves 28. The arithmetic is torch's fused
AdamW in the same order, with correctly rounded division and square root (`div_rn`,
`sqrt_rn`), so it matches `torch._fused_adamw_` to float32 rounding:

    g = grad / divisor;  p -= lr * wd * p;  m += (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g;   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)

`divisor` is a one-element device tensor (the step's gradient divisor, set without a host
sync); the other scalars are the piece's own, from its step (`cpu_offload.adamw_piece`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw(P, M, V, G, OUT, DIV, n, decay, beta1, beta2, step_size, bc2_sqrt, eps,
           HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.div_rn(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32), tl.load(DIV))
    p = tl.load(P + offs, mask=mask, other=0.0)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    p = p - decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def adamw_(state: dict, grad: torch.Tensor, pieces, *, out: torch.Tensor | None,
           divisor: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    """AdamW over `pieces` (start, end, lr x weight decay, step size, sqrt of the second bias
    correction: `cpu_offload.adamw_piece`) of the flat fp32 state {master, exp_avg,
    exp_avg_sq}; `out` (same length) gets the new parameters."""
    for a, b, decay, step_size, bc2_sqrt in pieces:
        n = b - a
        if n == 0:
            continue
        views = [state[k][a:b] for k in ("master", "exp_avg", "exp_avg_sq")]
        target = out[a:b] if out is not None else views[0]
        _adamw[(triton.cdiv(n, BLOCK),)](
            *views, grad[a:b], target, divisor, n, decay, beta1, beta2, step_size, bc2_sqrt,
            eps, HAS_OUT=out is not None, BLOCK=BLOCK)
