"""Checks of a fused-kernel implementation against the PyTorch fallback, forward and backward.

Shared by tests/layers/test_kernels.py (CPU, Triton's interpreter on CPU tensors, GPU). Each ``check_*`` builds
random inputs (never zeros) on `device`, runs the kernel with ``impl=...`` and the fallback
with autograd, and raises AssertionError naming the tensor and the error if they differ.

Tolerance (``TOL``): ``max|got - want| <= tol * max(1, max|want|)`` per tensor. Both sides
compute in float32 and round once to the dtype, so they differ by float32 reduction order
(fp32) or by about one rounding of the output dtype: bf16 keeps 8 bits (2^-8 = 0.4%), fp16
11 bits (0.05%). Gradients get a few roundings more (the fused backward starts from the
rounded forward output, the fallback's autograd from the float32 one), hence 2% / 0.5%.
"""
from __future__ import annotations

import torch

from bench.experimental import kernels as X
from megazoo import kernels as K

TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _close(name: str, got: torch.Tensor | None, want: torch.Tensor | None, dtype) -> None:
    """Assert got ~ want with the dtype's tolerance, scaled by want's largest magnitude."""
    assert (got is None) == (want is None), f"{name}: one side has no value"
    if got is None:
        return
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= TOL[dtype] * scale, f"{name}: max abs error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _compare(fn_fused, fn_ref, inputs: list[torch.Tensor], dtype, label: str) -> None:
    """Run both on clones of `inputs`, compare outputs and gradients w.r.t. every input."""
    a, b = [_leaf(t) for t in inputs], [_leaf(t) for t in inputs]
    ya, yb = fn_fused(*a), fn_ref(*b)
    _close(f"{label} output", ya, yb, dtype)
    dy = torch.randn_like(yb)
    ga = torch.autograd.grad(ya, a, dy, allow_unused=True)
    gb = torch.autograd.grad(yb, b, dy, allow_unused=True)
    for k, (x, y) in enumerate(zip(ga, gb)):
        _close(f"{label} grad[{k}]", x, y, dtype)


def _gen(device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def check_softmax(impl: str, device, dtype, shape=(2, 3, 17, 17), alibi=True, causal=True) -> None:
    """scaled_masked_softmax(impl) vs softmax_reference on scores of `shape`."""
    g = _gen(device, 1)
    scores = 4 * torch.randn(shape, device=device, generator=g).to(dtype)
    slopes = torch.rand(shape[1], device=device, generator=g) if alibi else None
    scale = 0.3
    _compare(lambda s: X.scaled_masked_softmax(s, scale, slopes, causal, impl=impl),
             lambda s: X.softmax_reference(s, scale, slopes, causal), [scores], dtype,
             f"softmax{tuple(shape)} alibi={alibi} causal={causal}")


def _norm_input(shape, device, g, dtype, strided: bool, shift: float = 0.0) -> torch.Tensor:
    """Random x of `shape`; `strided`: a transposed view (rows not contiguous in memory)."""
    if not strided:
        return (torch.randn(shape, device=device, generator=g) * 2 + shift).to(dtype)
    full = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device, generator=g)
    return (full * 2 + shift).to(dtype).transpose(-1, -2)


def check_layer_norm(impl: str, device, dtype, shape=(5, 7, 100), weight_dtype=None,
                     strided=False) -> None:
    """layer_norm(impl) vs layer_norm_reference; weights in `weight_dtype` (default: dtype)."""
    g = _gen(device, 2)
    n = shape[-1]
    x = _norm_input(shape, device, g, dtype, strided, shift=0.5)
    w = (1 + 0.3 * torch.randn(n, device=device, generator=g)).to(weight_dtype or dtype)
    b = (0.3 * torch.randn(n, device=device, generator=g)).to(weight_dtype or dtype)
    _compare(lambda x_, w_, b_: K.layer_norm(x_, w_, b_, 1e-5, impl=impl),
             lambda x_, w_, b_: K.layer_norm_reference(x_, w_, b_, 1e-5), [x, w, b], dtype,
             f"layer_norm{tuple(shape)}")


def check_rms_norm(impl: str, device, dtype, shape=(5, 7, 100), weight_dtype=None,
                   strided=False) -> None:
    """rms_norm(impl) vs rms_norm_reference."""
    g = _gen(device, 3)
    n = shape[-1]
    x = _norm_input(shape, device, g, dtype, strided)
    w = (1 + 0.3 * torch.randn(n, device=device, generator=g)).to(weight_dtype or dtype)
    _compare(lambda x_, w_: K.rms_norm(x_, w_, 1e-6, impl=impl),
             lambda x_, w_: K.rms_norm_reference(x_, w_, 1e-6), [x, w], dtype,
             f"rms_norm{tuple(shape)}")


def check_bias_gelu(impl: str, device, dtype, shape=(5, 7, 100), approximate="tanh") -> None:
    """bias_gelu(impl) vs bias_gelu_reference (values spread over +-8 to reach both tails)."""
    g = _gen(device, 4)
    x = (3 * torch.randn(shape, device=device, generator=g)).to(dtype)
    b = torch.randn(shape[-1], device=device, generator=g).to(dtype)
    _compare(lambda x_, b_: X.bias_gelu(x_, b_, approximate, impl=impl),
             lambda x_, b_: X.bias_gelu_reference(x_, b_, approximate), [x, b], dtype,
             f"bias_gelu{tuple(shape)} {approximate}")


def check_rope(impl: str, device, dtype, s=9, b=2, heads=(3,), d=16, batch_cos=False,
               strided=False) -> None:
    """apply_rope(impl) vs rope_reference; `strided`: x is q sliced out of a fused qkv."""
    g = _gen(device, 5)
    pos = torch.arange(s, device=device) + 3
    if batch_cos:
        pos = torch.stack([pos, pos * 2])[:b] if b <= 2 else pos.expand(b, s)
    cos, sin = X.rope_cos_sin(pos, d, 10000.0)
    shape = (s, b, *heads, d)
    if strided:
        qkv = torch.randn(s, b, *heads, 3 * d, device=device, generator=g).to(dtype)
        x = qkv[..., d:2 * d]
        fused = X.apply_rope(x, cos, sin, impl=impl)  # the non-contiguous input itself
        _close("rope strided output", fused, X.rope_reference(x, cos, sin), dtype)
    x = torch.randn(shape, device=device, generator=g).to(dtype)
    _compare(lambda x_: X.apply_rope(x_, cos, sin, impl=impl),
             lambda x_: X.rope_reference(x_, cos, sin), [x], dtype,
             f"rope{shape} batch_cos={batch_cos}")


CHECKS = {
    "softmax": check_softmax, "layer_norm": check_layer_norm, "rms_norm": check_rms_norm,
    "bias_gelu": check_bias_gelu, "rope": check_rope,
}

#: Small cases for Triton's CPU interpreter (slow: a few thousand elements each), run in every
#: dtype. Awkward on purpose: row lengths that are not powers of two (masked blocks), row
#: counts that leave the norms' last backward program partly past the end, one row, float32
#: weights under bf16/fp16 inputs, a strided (non-contiguous) input.
INTERPRETER_CASES = {
    "softmax-alibi-causal": ("softmax", dict(shape=(2, 3, 17, 17))),
    "softmax-causal-sq<sk": ("softmax", dict(shape=(1, 2, 5, 33), alibi=False)),
    "softmax-alibi-full": ("softmax", dict(shape=(1, 2, 7, 20), causal=False)),
    "layer_norm-n100": ("layer_norm", dict(shape=(5, 7, 100))),
    "layer_norm-n33-fp32weights": ("layer_norm", dict(shape=(9, 33), weight_dtype=torch.float32)),
    "layer_norm-one-row-n1539": ("layer_norm", dict(shape=(1, 1539))),
    "layer_norm-13rows-n1": ("layer_norm", dict(shape=(13, 1))),
    "layer_norm-strided": ("layer_norm", dict(shape=(6, 5, 48), strided=True)),
    "rms_norm-n100": ("rms_norm", dict(shape=(5, 7, 100))),
    "rms_norm-13rows-n257-fp32weights": ("rms_norm", dict(shape=(13, 257),
                                                          weight_dtype=torch.float32)),
    "rms_norm-strided": ("rms_norm", dict(shape=(2, 3, 4, 40), strided=True)),
    "bias_gelu-tanh": ("bias_gelu", dict(shape=(5, 7, 100))),
    "bias_gelu-erf": ("bias_gelu", dict(shape=(3, 33), approximate="none")),
    "rope": ("rope", dict(s=9, b=2, heads=(3,), d=16)),
    "rope-strided-batchcos-gqa": ("rope", dict(s=5, b=2, heads=(2, 3), d=12, batch_cos=True,
                                                strided=True)),
}
