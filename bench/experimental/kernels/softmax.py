"""Fused scale + ALiBi + causal mask + softmax over attention scores, with a PyTorch fallback.

Experimental, outside the library: the model's attention never materialises the scores it
would take (fused SDPA / FlexAttention / flash-attn); it serves bench/kernels_bench.py.

Function computed by every implementation, for ``scores [b, h, sq, sk]`` (query i, key j),
in float32, rounded once to ``scores.dtype``:

    z[b, h, i, j] = scale * scores[b, h, i, j] + slope[h] * j        (slope term: ALiBi only)
    probs = softmax over j of z, where causal keeps only j <= i + (sk - sq)

The causal mask is aligned bottom-right (query i sits at key position i + sk - sq, as with
a KV cache; with sq == sk it is the usual lower triangle, Megatron's upper-triangular mask).
Causal needs sq <= sk, so that no row is fully masked. The ALiBi term is BLOOM's
``slope * j``; under a causal mask softmax makes it equal to ``-slope * (i - j)``, the form
``megazoo.layers.positions.alibi_bias`` and flash-attn use (a per-row constant cancels).
``alibi_slopes [h]`` are constants (no gradient). Gradient: ``dscores = scale * p * (dp -
sum_j(dp * p))``; masked entries get 0.

Why Triton: a row softmax is a reduction plus elementwise work, memory-bound; Triton matches
hand CUDA (Megatron's scaled_upper_triang_masked_softmax) with far less code, autotunes the
warps per row length on each GPU, and needs no toolkit at install time.
"""
from __future__ import annotations

import torch

from megazoo.kernels import _dispatch

TRITON_MODULE = "bench.experimental.kernels.triton_softmax"

MAX_SK = 16384  # as triton_softmax.MAX_SK (not imported: triton may be absent)


def softmax_reference(scores: torch.Tensor, scale: float, alibi_slopes: torch.Tensor | None = None,
                      causal: bool = True) -> torch.Tensor:
    """The PyTorch fallback: float32 (float64 for float64) math, result in scores.dtype."""
    _check(scores, alibi_slopes, causal)
    sq, sk = scores.shape[-2:]
    f = _dispatch.compute_dtype(scores)
    z = scores.to(f) * scale
    if alibi_slopes is not None:
        j = torch.arange(sk, device=scores.device, dtype=f)
        z = z + alibi_slopes.detach().to(f).view(-1, 1, 1) * j  # [h, 1, sk] over b, i
    if causal:
        i = torch.arange(sq, device=scores.device)[:, None]
        j = torch.arange(sk, device=scores.device)[None, :]
        z = z.masked_fill(j > i + (sk - sq), float("-inf"))
    return torch.softmax(z, dim=-1).to(scores.dtype)


def _check(scores: torch.Tensor, alibi_slopes: torch.Tensor | None, causal: bool) -> None:
    """Validate shapes with messages that say what to change."""
    if scores.dim() != 4:
        raise ValueError(f"scores must be [b, heads, sq, sk], got shape {tuple(scores.shape)}")
    sq, sk = scores.shape[-2:]
    if causal and sq > sk:
        raise ValueError(f"causal softmax needs sq <= sk (else rows are fully masked), "
                         f"got sq={sq}, sk={sk}")
    if alibi_slopes is not None and alibi_slopes.shape != (scores.shape[1],):
        raise ValueError(f"alibi_slopes must be [heads={scores.shape[1]}], "
                         f"got {tuple(alibi_slopes.shape)}")


class _TritonSoftmax(torch.autograd.Function):
    """forward: probs = softmax(scale*scores + alibi, causal) by Triton; backward: by Triton.

    scores, probs [b, h, sq, sk]; slopes [h] fp32; saved: probs.
    """

    @staticmethod
    def forward(ctx, scores, scale, slopes, causal):
        kernels = _dispatch.triton_module(TRITON_MODULE)
        probs = kernels.softmax_forward(scores.contiguous(), scale, slopes, causal)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, dprobs):
        (probs,) = ctx.saved_tensors
        kernels = _dispatch.triton_module(TRITON_MODULE)
        return kernels.softmax_backward(dprobs.contiguous(), probs, ctx.scale), None, None, None


def unsupported(scores: torch.Tensor) -> str | None:
    """Why the fused softmax cannot take these scores, or None if it can."""
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {scores.dtype} has no fused kernel"
    if scores.shape[-1] > MAX_SK or scores.numel() == 0:
        return f"key length {scores.shape[-1]} or empty input outside the fused range (sk <= {MAX_SK})"
    return None


def scaled_masked_softmax(scores: torch.Tensor, scale: float = 1.0,
                          alibi_slopes: torch.Tensor | None = None, causal: bool = True, *,
                          impl: str | None = None) -> torch.Tensor:
    """softmax(scale * scores [+ slope_h * j]) over keys, causal-masked; see module docstring.

    scores [b, h, sq, sk] -> probs [b, h, sq, sk] in scores.dtype. `impl`: None picks the
    best available ("triton" on a GPU, else "torch"), or force "triton" / "torch".
    """
    _check(scores, alibi_slopes, causal)
    if _dispatch.pick(scores, impl, unsupported=unsupported(scores)) == "triton":
        slopes = None if alibi_slopes is None else alibi_slopes.detach().float().contiguous()
        return _TritonSoftmax.apply(scores, float(scale), slopes, causal)
    return softmax_reference(scores, scale, alibi_slopes, causal)
