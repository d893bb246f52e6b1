"""GPU backends against the float32 math reference, with gradients (skipped without CUDA).

Tolerance: float32 inputs: rtol 1e-3 / atol 1e-3 x the largest entry (the GPU kernels may
use TF32 tensor cores for the two matmuls: 10-bit mantissas). bfloat16 inputs: 2e-2 relative
to the largest entry (8-bit mantissa; the reference computes in float32 from the same bf16
inputs, the kernels keep bf16 probabilities before the second matmul).
"""
import itertools

import pytest
import torch

from megazoo.layers import alibi_slopes, core_attention
from megazoo.layers.attention_kernels import flash_available

S, B, D = 300, 2, 64
CASES = list(itertools.product([False, True], [False, True], [(8, 8), (8, 2)]))


def _close(got, want, dtype):
    rel = 1e-3 if dtype == torch.float32 else 2e-2
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale)


def _run(backend, dtype, padded, alibi, heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(S, B, h, D, device="cuda", generator=g).to(dtype).requires_grad_()
               for h in (heads[0], heads[1], heads[1]))
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.bool, device="cuda")
        mask[0, :17] = False
        mask[1, -40:] = False
    slopes = alibi_slopes(heads[0], device="cuda") if alibi else None
    out = core_attention(q, k, v, padding_mask=mask, alibi_slopes=slopes, backend=backend)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return out, grads


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded, alibi, heads", CASES)
def test_gpu_backend_matches_math(backend, dtype, padded, alibi, heads):
    if backend == "flash" and (not flash_available() or dtype == torch.float32 or padded):
        pytest.skip("flash-attn: not installed, or a float32 / padded call it does not take")
    out, grads = _run(backend, dtype, padded, alibi, heads)
    ref, grads_ref = _run("math", dtype, padded, alibi, heads)
    _close(out, ref, dtype)
    for got, want in zip(grads, grads_ref):
        _close(got, want, dtype)
