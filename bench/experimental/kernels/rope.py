"""Fused rotary position embedding (RoPE, Hugging Face LLaMA convention) with a fallback.

Experimental, outside the library: the model's attention applies RoPE inside its fused
attention path (`megazoo.layers.positions`); this kernel serves bench/kernels_bench.py.

Layout and signature match ``megazoo.layers.positions`` (the attention code), so
``apply_rope`` here can replace that one call for call:

| name | shape | meaning |
|---|---|---|
| x (q or k) | [s, b, *heads, d] | the package's sequence-first layout, d even |
| cos, sin | [s, b or 1, d] | rotary factors, each half of d repeated (HF `cat((freqs, freqs))`) |

Function computed by every implementation, in float32, rounded once to ``x.dtype``:
``y = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``.
(``positions.apply_rope`` returns torch's promoted dtype, float32 when cos is float32;
here the result keeps x's dtype, which the attention kernels need.) cos and sin are
constants: no gradient flows to them. ``rope_cos_sin`` and ``rotate_half`` are
``positions``' own (re-exported): the fallback is the attention code's formula.

Why Triton: RoPE is elementwise with a gather of the other half; fused, it reads x and the
small cos/sin once and writes y once, with a strided x (q/k views of a fused QKV tensor)
and no copies, in a few dozen lines that compile at run time on any GPU.
"""
from __future__ import annotations

import torch

from megazoo.kernels import _dispatch
from megazoo.layers.positions import rope_cos_sin, rotate_half  # noqa: F401 (the one RoPE math)

TRITON_MODULE = "bench.experimental.kernels.triton_rope"


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Validate shapes; return the broadcast view shape of cos/sin over x."""
    if x.dim() < 3 or x.shape[-1] % 2 != 0:
        raise ValueError(f"apply_rope: x must be [s, b, *heads, d] with d even, got {tuple(x.shape)}")
    ok = (cos.dim() == 3 and cos.shape == sin.shape and cos.shape[0] == x.shape[0]
          and cos.shape[1] in (1, x.shape[1]) and cos.shape[-1] == x.shape[-1])
    if not ok:
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)}, {tuple(sin.shape)} do not match "
                         f"x {tuple(x.shape)} (expected [s, b or 1, d] with s={x.shape[0]}, "
                         f"b={x.shape[1]}, d={x.shape[-1]})")
    return (cos.shape[0], cos.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The PyTorch fallback: x * cos + rotate_half(x) * sin in float32 (float64 for float64)."""
    view = _check(x, cos, sin)
    f = _dispatch.compute_dtype(x)
    c, s = cos.detach().to(f).view(view), sin.detach().to(f).view(view)
    xf = x.to(f)
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


class _TritonRope(torch.autograd.Function):
    """forward: y = rope(x) by Triton; backward: dx = rope^T(dy) by Triton (cos, sin constant).

    x [s, b, H, d] (heads flattened), cos, sin [s, b or 1, d] contiguous; saved: cos, sin.
    """

    @staticmethod
    def forward(ctx, x4, cos, sin):
        kernels = _dispatch.triton_module(TRITON_MODULE)
        ctx.save_for_backward(cos, sin)
        return kernels.rope(x4, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        kernels = _dispatch.triton_module(TRITON_MODULE)
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        return kernels.rope(dy, cos, sin, backward=True), None, None


def unsupported(x: torch.Tensor) -> str | None:
    """Why the fused RoPE cannot take x, or None if it can."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} has no fused kernel"
    if x.shape[-1] > 1024 or x.numel() == 0:
        return f"head dim {x.shape[-1]} or empty input outside the fused range (d <= 1024)"
    return None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               impl: str | None = None) -> torch.Tensor:
    """Rotate x [s, b, *heads, d] by cos, sin [s, b or 1, d]; result in x.dtype.

    `impl`: None picks the best available ("triton" on a GPU, else "torch"), or force one.
    """
    _check(x, cos, sin)
    if _dispatch.pick(x, impl, unsupported=unsupported(x)) == "torch":
        return rope_reference(x, cos, sin)
    s_len, batch, d = x.shape[0], x.shape[1], x.shape[-1]
    x4 = x.reshape(s_len, batch, -1, d)  # a view when the head dims merge, else a copy
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    cos_c, sin_c = cos.detach().contiguous(), sin.detach().contiguous()
    return _TritonRope.apply(x4, cos_c, sin_c).view(x.shape)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope on queries and keys (k may have fewer heads, GQA): (q_rot, k_rot)."""
    return apply_rope(q, cos, sin, impl=impl), apply_rope(k, cos, sin, impl=impl)
