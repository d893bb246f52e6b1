"""FP8 linear: y = x W^T + b with its three GEMMs in FP8 and dynamic scaling.

FP8 is a compute format here: weights, biases, activations and gradients stay in the run's
dtype (bf16); each GEMM casts its two operands to FP8 with fresh scales (see `kernels/fp8_cast.py`
for amax / scale / cast), multiplies with float32 accumulation and writes the run's dtype.
How (format, scaling, cast kernel) is an `FP8Recipe` (`megazoo/config/precision.py`).

| GEMM | product | a (row-major) | b (column-major) | reduction | out |
|---|---|---|---|---|---|
| forward | y = x W^T   | x [M, K], fwd dtype   | W^T [K, N], fwd dtype | K | [M, N] |
| dgrad   | dx = dy W   | dy [M, N], grad dtype | W [N, K], fwd dtype   | N | [M, K] |
| wgrad   | dW = dy^T x | dy^T [N, M], grad     | x [M, K], fwd dtype   | M | [N, K] |

(M = tokens, K = in features, N = out features.) fwd dtype is e4m3; grad dtype is e4m3
(format "e4m3") or e5m2 (format "hybrid": more range for gradients, as in Transformer
Engine). Recipe "tensorwise": one scale per operand, which does not depend on the layout,
so x and dy are each cast once into both layouts their GEMMs read (one kernel writes both)
and the weight's transposed operand is its forward cast transposed. Recipe "rowwise": one
scale per row of `a` and per column of `b`, i.e. per index of the non-reduced dimension, so
each GEMM casts its operands afresh along its own reduction.

Inside `fp8_weight_cache()` a weight is cast once per step, however many micro-batches use it.

On CUDA the GEMMs are `torch._scaled_mm` (needs compute capability 8.9+: Ada, Hopper), on
other devices (or with `emulate=True`) an emulation computing the recipe's definition:
the same FP8 values and scales, dequantized and multiplied in float32. `_scaled_mm` needs
every dimension a multiple of 16; a call with M, K or N that is not runs `F.linear` in the
run's dtype (`fallback=True`, the default) or raises.

A weight whose gradient owner fuses gradient accumulation (`wgrad`) gets its wgrad GEMM
summed straight into its fp32 main gradient (cuBLASLt, tensorwise on CUDA; otherwise the
GEMM's output is added there).
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings

import torch

from ..config.precision import FP8Recipe
from ..kernels.fp8_cast import quantize, quantize_both, transpose
from ..parallel.device import compute_capability
from . import wgrad


def _cuda_fp8_capable(index: int) -> tuple[bool, str]:
    major, minor = compute_capability(torch.device("cuda", index))
    return (major, minor) >= (8, 9), f"sm_{major}{minor}"


def check_fp8_device(recipe: FP8Recipe | None, device: torch.device) -> None:
    """Raise one line when `recipe` asks for FP8 GEMMs a CUDA device cannot run (other devices
    run the emulation). Layers call it before their first collective, so every rank raises."""
    if recipe is None or recipe.emulate or device.type != "cuda":
        return
    ok, arch = _cuda_fp8_capable(device.index if device.index is not None else 0)
    if not ok:
        raise ValueError(f"FP8 GEMMs need FP8 tensor cores (compute capability 8.9+: Ada, "
                         f"Hopper); {device} is {arch}: run without FP8 (--fp8-format)")


def check_fp8_run(recipe: FP8Recipe | None, device: torch.device) -> None:
    """A training run's check, before its first collective: FP8 only pays on FP8 tensor
    cores, and the CPU path is an emulation for tests (exact numbers, no speed-up)."""
    if recipe is None:
        return
    if device.type != "cuda":
        raise ValueError(f"--fp8-format needs a GPU with FP8 tensor cores (compute capability "
                         f"8.9+: Ada, Hopper); this run is on {device.type}, where FP8 is only "
                         f"emulated, for tests: remove --fp8-format")
    check_fp8_device(recipe, device)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool, fast_accum: bool = False) -> torch.Tensor:
    """(a @ b) * inv_a * inv_b: a [M, K] row-major fp8, b [K, N] column-major fp8, inv_a []
    or [M, 1], inv_b [] or [1, N] (float32). Emulated: dequantized, multiplied in float32."""
    if emulate or a.device.type != "cuda":
        return ((a.float() @ b.float()) * inv_a * inv_b).to(out_dtype)
    rowwise = inv_a.dim() > 0
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, use_fast_accum=fast_accum,
                           out_dtype=torch.bfloat16 if rowwise else out_dtype)
    return out.to(out_dtype)


def _row(inv: torch.Tensor) -> torch.Tensor:
    """A column operand's scales [K, 1] (from quantizing its transpose) as [1, K]."""
    return inv.reshape(1, -1) if inv.dim() > 0 else inv


def _impl(recipe: FP8Recipe) -> str:
    """The recipe's cast implementation; the emulation uses the eager definition."""
    return "eager" if recipe.emulate else recipe.cast


def _cast(t: torch.Tensor, dtype: torch.dtype, recipe: FP8Recipe, transpose: bool = False):
    """Quantize t (or t.t()) by the recipe's scaling."""
    return quantize(t, dtype, recipe.rowwise, transpose, impl=_impl(recipe))


_WEIGHT_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "megazoo_fp8_weight_casts", default=None)


@contextlib.contextmanager
def fp8_weight_cache():
    """Within this block each FP8 weight is cast once, however many micro-batches use it:
    the training engines wrap one step's micro-batches in it (the weights cannot change before
    the optimizer step). Outside it every call casts afresh; the casts are dropped on exit."""
    token = _WEIGHT_CASTS.set({})
    try:
        yield
    finally:
        _WEIGHT_CASTS.reset(token)


class _WeightCasts:
    """A weight's FP8 operands: forward wq [N, K] and backward W^T [K, N] (row-major), each
    computed on first use (tensorwise: the backward one is the forward one transposed, same
    scale; rowwise: scaled per k, along the dgrad GEMM's reduction)."""

    def __init__(self, weight: torch.Tensor, recipe: FP8Recipe):
        self.weight, self.recipe = weight, recipe
        self._fwd = self._bwd = None

    @classmethod
    def of(cls, weight: torch.Tensor, recipe: FP8Recipe) -> "_WeightCasts":
        cache = _WEIGHT_CASTS.get()
        if cache is None:
            return cls(weight, recipe)
        key = (id(weight), recipe)
        entry = cache.get(key)
        if entry is None or entry.weight is not weight:
            entry = cache[key] = cls(weight, recipe)
        return entry

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fwd is None:
            self._fwd = _cast(self.weight.detach(), self.recipe.fwd_dtype, self.recipe)
        return self._fwd

    def backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bwd is None:
            r = self.recipe
            if r.rowwise:
                self._bwd = _cast(self.weight.detach(), r.fwd_dtype, r, transpose=True)
            else:
                wq, inv_w = self.forward()
                self._bwd = (transpose(wq, _impl(r)), inv_w)  # same values, same scale
        return self._bwd


class _FP8Linear(torch.autograd.Function):
    """x [M, K], weight [N, K] -> y [M, N] in x's dtype; the table in the module docstring.

    Saved for backward: tensorwise, the forward's FP8 cast of x in both layouts (xq [M, K],
    x^T [K, M]) and its scale; rowwise, x itself (the backward scales it along the other
    axis). The weight's operands come from `_WeightCasts` (per step under `fp8_weight_cache`).
    """

    @staticmethod
    def forward(ctx, x, weight, recipe):
        f = recipe.fwd_dtype
        casts = _WeightCasts.of(weight, recipe)
        if recipe.rowwise or not ctx.needs_input_grad[1]:
            xq, inv_x = _cast(x, f, recipe)                               # [M, K]
            xtq = None
        else:
            xq, xtq, inv_x = quantize_both(x, f, _impl(recipe))           # [M, K], [K, M]
        wq, inv_w = casts.forward()                                       # [N, K]
        y = scaled_mm(xq, wq.t(), inv_x, _row(inv_w), x.dtype, recipe.emulate,
                      recipe.fast_accum)                                  # [M, N]
        ctx.recipe, ctx.casts, ctx.x_dtype, ctx.w_dtype = recipe, casts, x.dtype, weight.dtype
        ctx.fused_weight = weight if wgrad.fuses_wgrad(weight) else None
        if recipe.rowwise:
            ctx.save_for_backward(x)
        else:
            ctx.save_for_backward(xtq, inv_x)
        return y

    @staticmethod
    def backward(ctx, dy):
        r, (need_dx, need_dw, _) = ctx.recipe, ctx.needs_input_grad
        f, g = r.fwd_dtype, r.grad_dtype
        dy = dy.contiguous()                                              # [M, N]
        dx = dw = None
        if not r.rowwise:
            xtq, inv_x = ctx.saved_tensors
            if need_dw:
                dyq, dytq, inv_dy = quantize_both(dy, g, _impl(r))        # [M, N], [N, M]
            else:
                dyq, inv_dy = _cast(dy, g, r)
        if need_dx:
            if r.rowwise:
                dyq, inv_dy = _cast(dy, g, r)                             # per token
            wtq, inv_wt = ctx.casts.backward()                            # W^T [K, N]
            dx = scaled_mm(dyq, wtq.t(), inv_dy, _row(inv_wt), ctx.x_dtype, r.emulate)
        if need_dw:
            if r.rowwise:
                (x,) = ctx.saved_tensors
                dytq, inv_dyt = _cast(dy, g, r, transpose=True)           # dy^T [N, M], per n
                xtq, inv_xt = _cast(x, f, r, transpose=True)              # x^T [K, M], per k
            else:
                inv_dyt, inv_xt = inv_dy, inv_x
            def unfused():
                return scaled_mm(dytq, xtq.t(), inv_dyt, _row(inv_xt), ctx.w_dtype, r.emulate)
            if ctx.fused_weight is None:
                dw = unfused()
            elif r.emulate:
                dw = wgrad.add_to_main_grad(ctx.fused_weight, unfused())
            else:
                dw = wgrad.accumulate_fp8_wgrad(ctx.fused_weight, dytq, xtq, inv_dyt, inv_xt,
                                                unfused)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: FP8Recipe | None = None) -> torch.Tensor:
    """y = x W^T + b for x [..., K], weight [N, K]: `F.linear` when recipe is None.

    The bias is added after the GEMM, in the run's dtype. Tokens M = prod(x.shape[:-1]),
    K and N must be multiples of 16 for the FP8 path (else see `FP8Recipe.fallback`).
    """
    if recipe is None:
        return wgrad.linear(x, weight, bias)
    check_fp8_device(recipe, x.device)
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if m % 16 or k % 16 or n % 16 or m == 0:
        if not recipe.fallback:
            raise ValueError(f"FP8 GEMM needs every dimension a positive multiple of 16; this "
                             f"linear has tokens={m}, in={k}, out={n}: change the sizes or "
                             f"allow the fallback (FP8Recipe(fallback=True))")
        warnings.warn(f"FP8 linear in={k} out={n}: tokens={m} or a feature size is not a "
                      f"multiple of 16; this call runs in {x.dtype}", stacklevel=2)
        return wgrad.linear(x, weight, bias)
    y = _FP8Linear.apply(x.reshape(m, k), weight, recipe).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias
