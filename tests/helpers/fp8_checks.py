"""Rank-side checks of the FP8 tensor-parallel layers (run on 2 gloo ranks, tp = 2).

Each rank runs Column/RowParallelLinear(fp8=recipe), with and without Megatron sequence
parallelism, and compares output, input gradient and weight gradient with two one-process
computations on the full tensors:

* `per_shard`: the one-process FP8 emulation applied shard by shard (each rank's GEMM with
  the scales of its shard, then the sums / concatenations tp performs). The parallel layer
  must equal it: same FP8 values, same float32 products; only the sum of the two partials
  may be associated differently by the collective. Tolerance rtol 1e-6, atol 1e-6 (fp32,
  values O(1)): a few ulps, far below one FP8 rounding (2^-4 relative).
* `whole`: the one-process FP8 layer with per-tensor scales. It differs where tp shards a
  scaled dimension (see megazoo/layers/linear.py): relative Frobenius error under 0.1, a
  few FP8 roundings (e4m3 rounds to 2^-4 relative, e5m2 to 2^-3). Where no scale is
  per-shard (rowwise: the column forward and weight gradient, the row input gradient) the
  results must be equal to the per-shard ones, hence to float32 rounding.
"""
import torch

from megazoo.config.precision import FP8Recipe
from megazoo.layers import ColumnParallelLinear, RowParallelLinear
from megazoo.layers.fp8 import fp8_linear
from megazoo.parallel import ParallelConfig, ParallelState

S, B, IN, OUT = 16, 2, 64, 96
TOL = dict(rtol=1e-6, atol=1e-6)


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _run(fn, x, g):
    """(y, dx, dW) of y = fn(x) with output gradient g, W the weight fn returns last."""
    x = x.detach().clone().requires_grad_()
    y, params = fn(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, [p.grad for p in params]


def _column_refs(x, w, b, recipe, g, tp):
    def per_shard(x):
        ws = [w.chunk(tp)[r].clone().requires_grad_() for r in range(tp)]
        y = torch.cat([fp8_linear(x, ws[r], b.chunk(tp)[r], recipe) for r in range(tp)], -1)
        return y, ws

    def whole(x):
        wf = w.clone().requires_grad_()
        return fp8_linear(x, wf, b, recipe), [wf]
    shard = _run(per_shard, x, g)
    return (shard[0], shard[1], torch.cat(shard[2])), _run(whole, x, g)


def _row_refs(x, w, b, recipe, g, tp):
    def per_shard(x):
        ws = [w.chunk(tp, dim=1)[r].clone().requires_grad_() for r in range(tp)]
        parts = [fp8_linear(x.chunk(tp, dim=-1)[r], ws[r], None, recipe) for r in range(tp)]
        return sum(parts) + b, ws

    def whole(x):
        wf = w.clone().requires_grad_()
        return fp8_linear(x, wf, b, recipe), [wf]
    shard = _run(per_shard, x, g)
    return (shard[0], shard[1], torch.cat(shard[2], dim=1)), _run(whole, x, g)


def _layer_run(kind, state, recipe, sp, x, w, b, g):
    """Rank-local (y, dx, dW) of the tp layer, gathered back to full tensors for comparison."""
    tp, r = state.tp.size, state.tp.rank
    cls, wdim = (ColumnParallelLinear, 0) if kind == "column" else (RowParallelLinear, 1)
    layer = cls(IN, OUT, group=state.tp, sequence_parallel=sp, fp8=recipe)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(tp, dim=wdim)[r])
        layer.bias.copy_(b.chunk(tp)[r] if kind == "column" else b)
    x_in = x
    if kind == "row":
        x_in = x.chunk(tp, dim=-1)[r]
    if sp and kind == "column":
        x_in = x.chunk(tp, dim=0)[r]
    x_in = x_in.detach().clone().requires_grad_()
    y = layer(x_in)
    g_local = g.chunk(tp, dim=-1)[r] if kind == "column" else g
    g_local = g_local.chunk(tp, dim=0)[r] if (sp and kind == "row") else g_local
    (y * g_local).sum().backward()
    return y.detach(), x_in.grad, layer.weight.grad


def check_fp8_layers(recipes):
    """Every recipe, column and row, without and with SP: the checks of the module docstring."""
    state = ParallelState.initialize(ParallelConfig(tp=2))
    tp, r = state.tp.size, state.tp.rank
    x, g = _data(S, B, IN, seed=1), _data(S, B, OUT, seed=2)
    wc, bc = _data(OUT, IN, seed=3), _data(OUT, seed=4)
    errors = {}
    for fmt, rec in recipes:
        recipe = FP8Recipe(fmt, rec)
        for kind, refs in (("column", _column_refs), ("row", _row_refs)):
            shard, whole = refs(x, wc, bc, recipe, g, tp)
            for sp in (False, True):
                y, dx, dw = _layer_run(kind, state, recipe, sp, x, wc, bc, g)
                out_dim, w_dim = (-1, 0) if kind == "column" else (0 if sp else None, 1)
                x_dim = (0 if sp else None) if kind == "column" else -1
                pick = lambda t, d: t if d is None else t.chunk(tp, dim=d)[r]  # noqa: E731
                torch.testing.assert_close(y, pick(shard[0], out_dim), **TOL)
                torch.testing.assert_close(dx, pick(shard[1], x_dim), **TOL)
                torch.testing.assert_close(dw, pick(shard[2], w_dim), **TOL)
                errors[(fmt, rec, kind, sp)] = [_rel(a, b) for a, b in zip(shard, whole[:2])] + [
                    _rel(shard[2], whole[2][0])]
    return errors
