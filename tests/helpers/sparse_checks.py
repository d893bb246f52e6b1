"""Block-sparse attention paths against the dense-mask float32 path: the output and the q / k /
v gradients of one call, and the comparison the plan tests share."""
from __future__ import annotations

import torch

from megazoo.layers.sparse import sparse_attention


def outputs_and_grads(lay, block, causal, q, k, v, grad, backend, plan=None) -> tuple:
    """(out, dq, dk, dv) of `sparse_attention` on fresh leaf copies of q, k, v."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attention(*leaves, lay, block, causal=causal, backend=backend, plan=plan)
    return (out, *torch.autograd.grad(out, leaves, grad))


def assert_plan_equals_math(lay, block, causal, plan, q, k, v, grad, tol: float) -> None:
    """The plan's output within atol `tol` and its gradients within 10 tol (sums over s) of
    the dense-mask float32 path's."""
    ref, *ref_grads = outputs_and_grads(lay, block, causal, q, k, v, grad, "math")
    out, *grads = outputs_and_grads(lay, block, causal, q, k, v, grad, "gather", plan)
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=10 * tol, rtol=0)
