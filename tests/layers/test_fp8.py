"""FP8 linear (megazoo/layers/fp8.py): the CPU emulation against the recipe's definition,
against bf16, under tensor and sequence parallelism; on GPUs the real kernels against it.

The reference below is written from the definition alone: each operand dequantized with
its own scales (per tensor, or per index of the GEMM's non-reduced dimension), multiplied
in float64. The implementation multiplies the FP8 values in float32 and applies the
inverse scales to the product, so the two agree to float32 rounding: rtol 1e-5 (the
products of FP8 values are exact in float32; a sum of K of them and two scalings round).
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import fp8_checks
from megazoo.config.precision import FP8Recipe
from megazoo.layers import ColumnParallelLinear, FusedColumnParallelLinear
from megazoo.layers import fp8 as fp8_module
from megazoo.layers.fp8 import fp8_linear, fp8_weight_cache
from megazoo.kernels.fp8_cast import quantize, quantize_both, quantize_reference
from megazoo.kernels.fp8_cast import transpose as fp8_transpose
from megazoo.testing import run_distributed

RECIPES = [(f, r) for f in ("e4m3", "hybrid") for r in ("tensorwise", "rowwise")]
M, K, N = 48, 64, 32


def _deq(t, dtype, dim):
    """The definition: scale = max / amax (over `dim`, or all) in float32, cast, divide back."""
    top = torch.finfo(dtype).max
    a = t.abs().float()
    amax = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    scale = torch.full_like(amax, top) / amax.clamp(min=1e-12)  # true division, not top * (1/x)
    return (t.float() * scale).clamp(-top, top).to(dtype).double() / scale.double()


def _reference(x, w, b, dy, fmt, rec):
    f, g = torch.float8_e4m3fn, (torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn)
    row, col = (1, 0) if rec == "rowwise" else (None, None)
    y = _deq(x, f, row) @ _deq(w, f, row).T + b.double()      # reduction over K
    dx = _deq(dy, g, row) @ _deq(w, f, col)                    # reduction over N
    dw = _deq(dy, g, col).T @ _deq(x, f, col)                  # reduction over M
    return y, dx, dw, dy.double().sum(0)


def _run(x, w, b, dy, recipe):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, recipe)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w, b, dy = (torch.randn(*s, generator=gen) for s in ((M, K), (N, K), (N,), (M, N)))
    x[3] *= 50  # one outlier token: rowwise and tensorwise scales then differ a lot
    return [t.to(dtype) for t in (x, w, b, dy)]


@pytest.mark.parametrize("fmt,rec", RECIPES)
def test_emulation_equals_definition(fmt, rec):
    x, w, b, dy = _inputs()
    got = _run(x, w, b, dy, FP8Recipe(fmt, rec))
    for name, a, e in zip(("y", "dx", "dW", "db"), got, _reference(x, w, b, dy, fmt, rec)):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5 * e.abs().max().item(),
                                   msg=f"{name} of {fmt}/{rec}")


def test_reference_tells_recipes_apart():
    """The check above can fail: the other recipe's definition is far from each result."""
    x, w, b, dy = _inputs()
    y_tensor = _run(x, w, b, dy, FP8Recipe("e4m3", "tensorwise"))[0].double()
    y_row = _reference(x, w, b, dy, "e4m3", "rowwise")[0]
    assert ((y_tensor - y_row).norm() / y_row.norm()).item() > 1e-3


# Relative Frobenius error against bf16 F.linear (itself compared in float64): e4m3 rounds
# to 2^-4 relative, e5m2 to 2^-3; a GEMM of two rounded operands lands near 4-6 % (random
# data); the bounds leave room: 8 % for e4m3 operands, 12 % where e5m2 gradients enter.
@pytest.mark.parametrize("fmt,rec", RECIPES)
def test_bf16_run_close_to_bf16_linear(fmt, rec):
    x, w, b, dy = _inputs(torch.bfloat16, seed=1)
    got = _run(x, w, b, dy, FP8Recipe(fmt, rec))
    ref = _run(x.double(), w.double(), b.double(), dy.double(), None)
    bounds = (0.08,) + ((0.12, 0.12) if fmt == "hybrid" else (0.08, 0.08))
    for name, a, e, bound in zip(("y", "dx", "dW"), got, ref, bounds):
        assert a.dtype == torch.bfloat16, f"{name} is {a.dtype}, expected the run's bf16"
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < bound, f"{fmt}/{rec} {name}: relative error {err:.3f} >= {bound}"


def test_zero_tensor_scales_stay_finite():
    x = torch.zeros(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    for rec in ("tensorwise", "rowwise"):
        y = fp8_linear(x, w, None, FP8Recipe(recipe=rec))
        y.backward(torch.ones_like(y))
        assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(x.grad).all()
        assert torch.equal(w.grad, torch.zeros_like(w.grad))
        x.grad = w.grad = None


def test_fallback_and_bad_dimensions():
    x, w = torch.randn(4, 24), torch.randn(32, 24)   # in = 24: not a multiple of 16
    with pytest.warns(UserWarning, match="runs in torch.float32"):
        assert torch.equal(fp8_linear(x, w, None, FP8Recipe()), F.linear(x, w))
    with pytest.raises(ValueError, match=r"^FP8 GEMM needs every dimension a positive "
                       r"multiple of 16; this linear has tokens=4, in=24, out=32"):
        fp8_linear(x, w, None, FP8Recipe(fallback=False))


@pytest.mark.parametrize("kwargs,match", [
    (dict(format="e5m3"), r"^FP8 format must be one of \('e4m3', 'hybrid'\)"),
    (dict(recipe="delayed"), r"^FP8 recipe must be one of \('tensorwise', 'rowwise'\)"),
    (dict(cast="cuda"), r"^FP8 cast must be one of")])
def test_bad_recipe_is_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        FP8Recipe(**kwargs)
    assert "\n" not in str(info.value)


def test_layers_use_the_recipe():
    recipe = FP8Recipe("hybrid", "rowwise")
    x = torch.randn(8, 2, 64)
    for layer in (ColumnParallelLinear(64, 32, group=None, fp8=recipe),
                  FusedColumnParallelLinear(64, (16, 32), group=None, fp8=recipe)):
        assert layer.fp8 is recipe and "fp8=hybrid/rowwise" in repr(layer)
        torch.testing.assert_close(layer(x), fp8_linear(x, layer.weight, layer.bias, recipe),
                                   rtol=0, atol=0)


def test_tensor_and_sequence_parallel_equal_per_shard_emulation():
    """tp = 2 (column, row; with and without Megatron SP): see tests/helpers/fp8_checks.py."""
    errors = run_distributed(fp8_checks.check_fp8_layers, 2, RECIPES, timeout=240)[0]
    for (fmt, rec, kind, sp), errs in errors.items():
        assert max(errs) < 0.1, f"{fmt}/{rec} {kind} sp={sp}: per-shard vs per-tensor {errs}"
        if rec == "rowwise":  # scales taken over unsharded dimensions equal one process's
            exact = (0, 2) if kind == "column" else (1,)
            assert all(errs[i] < 1e-6 for i in exact), f"{fmt}/rowwise {kind}: {errs}"


# ---- GPU: the real kernels against the emulation ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["eager", "compile", "triton"])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", [(1024, 768), (40, 9000)])  # one-pass / looped row kernels
def test_gpu_fused_cast_equals_definition(impl, rowwise, transpose, shape):
    """Triton and eager: the definition's FP8 bits exactly (both divide correctly rounded);
    compiled: Inductor may round the division differently, which can move a value by one FP8
    step on a tie (at most 1e-3 of the elements); inverse scales to float32 rounding."""
    t = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, inv = quantize(t, dtype, rowwise, transpose, impl=impl)
        q_ref, inv_ref = quantize_reference(t, dtype, rowwise, transpose)
        assert q.shape == q_ref.shape and q.is_contiguous() and inv.shape == inv_ref.shape
        torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
        mismatch = (q.float() != q_ref.float()).float().mean().item()
        assert mismatch <= (1e-3 if impl == "compile" else 0.0), \
            f"{impl}: {mismatch:.2%} of the FP8 values differ"
        assert torch.equal(fp8_transpose(q, impl).view(torch.uint8),
                           q.t().contiguous().view(torch.uint8)), f"{impl} transpose"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,rec", RECIPES)
@pytest.mark.parametrize("cast", ["eager", "auto"])
def test_gpu_scaled_mm_equals_emulation(fmt, rec, cast):
    """torch._scaled_mm against the float32 emulation with the same FP8 operands: both
    accumulate in float32 and round to bf16 once; the forward's fast accumulation and the
    accumulation order leave a relative Frobenius error far below bf16's 2^-8: bound 1e-2."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, b, dy = (torch.randn(*s, device="cuda", generator=gen).bfloat16()
                   for s in ((512, 1024), (768, 1024), (768,), (512, 768)))
    got = _run(x, w, b, dy, FP8Recipe(fmt, rec, cast=cast))
    ref = _run(x, w, b, dy, FP8Recipe(fmt, rec, emulate=True))
    for name, a, e in zip(("y", "dx", "dW", "db"), got, ref):
        err = ((a.float() - e.float()).norm() / e.float().norm()).item()
        assert err < 1e-2, f"{fmt}/{rec} cast={cast} {name}: relative error {err:.2e}"


def test_weight_cache_casts_each_weight_once_and_changes_nothing(monkeypatch):
    """Under fp8_weight_cache two micro-batches give the outputs and gradients they give
    without it, and each weight is cast once for the forward (and once for the backward's
    W^T) instead of once per micro-batch; outside the block nothing is kept."""
    for rec in ("tensorwise", "rowwise"):
        recipe = FP8Recipe("hybrid", rec)
        x1, w, b, dy = _inputs()
        x2 = x1.flip(0) * 0.5
        plain = [_run(x, w, b, dy, recipe) for x in (x1, x2)]
        weight_casts = []
        real = fp8_module._cast
        monkeypatch.setattr(fp8_module, "_cast", lambda t, *a, **k: (
            weight_casts.append(t.shape) if t.shape == w.shape else None, real(t, *a, **k))[1])
        wp = w.detach().clone().requires_grad_()
        with fp8_weight_cache():
            cached = []
            for x in (x1, x2):
                xp, bp = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
                y = fp8_linear(xp, wp, bp, recipe)
                y.backward(dy)
                cached.append((y, xp.grad, wp.grad.clone(), bp.grad))
                wp.grad = None
        monkeypatch.setattr(fp8_module, "_cast", real)
        assert len(weight_casts) == (2 if rec == "rowwise" else 1), weight_casts
        for got, ref in zip(cached, plain):
            for a, e in zip(got, ref):
                assert torch.equal(a, e)
        assert fp8_module._WEIGHT_CASTS.get() is None


def test_both_layouts_cast_equals_cast_and_transpose():
    t = torch.randn(37, 52) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, qt, inv = quantize_both(t, dtype)
        q_ref, inv_ref = quantize_reference(t, dtype, False)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8))
        assert torch.equal(inv, inv_ref)


@pytest.mark.triton
@pytest.mark.parametrize("shape", [(64, 64), (100, 70), (33, 300)])
def test_triton_both_layouts_equal_the_one_layout_kernel(triton_device, shape):
    """The tiled cast writing q and q^T against the elementwise cast kernel (same amax kernel,
    same arithmetic) and its transpose: identical bytes and scale, awkward sizes included."""
    from megazoo.kernels import triton_fp8

    t = (torch.randn(*shape) * 3).to(torch.bfloat16).to(triton_device)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        top = torch.finfo(dtype).max
        q, qt, inv = triton_fp8.quantize_tensor_both(t, dtype, top, 1e-12)
        q1, inv1 = triton_fp8.quantize_tensor(t, dtype, top, 1e-12, False)
        assert q.shape == shape and qt.shape == shape[::-1]
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), q1.t().contiguous().view(torch.uint8))
        assert torch.equal(inv, inv1)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["eager", "compile", "triton"])
def test_gpu_both_layouts_cast_equals_definition(impl):
    t = torch.randn(1000, 776, device="cuda", dtype=torch.bfloat16) * 3
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, qt, inv = quantize_both(t, dtype, impl)
        q_ref, inv_ref = quantize_reference(t, dtype, False)
        torch.testing.assert_close(inv, inv_ref, rtol=1e-6, atol=0)
        mismatch = (q.float() != q_ref.float()).float().mean().item()
        assert mismatch <= (1e-3 if impl == "compile" else 0.0), \
            f"{impl}: {mismatch:.2%} of the FP8 values differ"
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
