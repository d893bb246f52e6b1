"""The block-sparse benchmark's correctness checks: on the GPU (`check`), every path against
the dense-mask float32 math path, and the cuDNN rectangle kernel against float32 math; on
CPU (`dry_run`), every layout and plan of the sweep at its real sizes and a small forward of
each path."""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import print_table
from bench.sparse_setup import (gather_plan, inputs, prepare_path, rect_share, sparse_configs,
                                tile_mask)
from megazoo.layers.sparse import SparseAttention, sparse_attention
from megazoo.layers.sparse.blocks import triton_reason
from megazoo.layers.sparse.layouts import density, layout
from megazoo.layers.sparse.merge import rect_backward, rect_forward, rect_kernel
from megazoo.layers.sparse.tiles import TILE
from megazoo.layers.sparse.rects import add_rects
from megazoo.layers.sparse.strided import strided_plan

TABLE = ["s", "config", "block", "path", "density", "tile_density", "rect_share", "note"]


def _paths(block: int, lay, s: int, device=None) -> list[str]:
    """The paths a layout can run; "triton" where its kernel runs on `device`."""
    strided = strided_plan(lay[:1], block, s, True) is not None
    triton = device is not None and triton_reason(device, 128, block, False) is None
    return (["flex"] + (["gather", "rects"] if 128 % block == 0 and block < 128 else [])
            + (["strided"] if strided else []) + (["triton"] if triton else []))


def _run(path, q, k, v, lay, block, s):
    """The output of one path: flex (the layout's tiles), gather (the plan, no rectangles),
    rects (the plan with rectangles forced: chunks of one tile, whatever share they cover) or
    strided (`sparse/strided.py`) or triton (`sparse/blocks.py`)."""
    if path in ("flex", "triton"):
        return sparse_attention(q, k, v, lay, block, causal=True, backend=path), None
    if path == "strided":
        plan = strided_plan(lay.to(q.device), block, s, True)
        return sparse_attention(q, k, v, lay, block, causal=True, backend="gather", plan=plan), plan
    plan = gather_plan(lay, block, s, q.device)
    if path == "rects":
        add_rects(plan, chunk=TILE, min_share=0.0)
    return sparse_attention(q, k, v, lay, block, causal=True, backend="gather", plan=plan), plan


def kernel_row(device, n=300, m=256, d=128, causal=False) -> dict:
    """The dense kernel of bf16 CUDA inputs (cuDNN's attention ops) against float32 math:
    output, log-sum-exp (natural log, [b, h, n]) and the backward given its own O and L;
    non-causal (the rectangles) or causal with n = m (the strided plan's global part)."""
    g = torch.Generator(device=device).manual_seed(1)
    m = n if causal else m
    q, k, v, do = (torch.randn(1, 2, x, d, device=device, generator=g, dtype=torch.bfloat16)
                   for x in (n, m, m, n))
    kind = rect_kernel(q)
    row = {"config": "causal_kernel" if causal else "rect_kernel", "block": None}
    try:
        out, lse, aux = rect_forward(kind, q, k, v, 0.1, causal)
        ref_out, ref_lse, _ = rect_forward("math", q, k, v, 0.1, causal)
        grads = rect_backward(kind, do, q, k, v, out, lse, aux, 0.1, causal)
        ref = rect_backward("math", do, q, k, v, out, lse, (), 0.1, causal)
        err = max([(out.float() - ref_out.float()).abs().max().item(),
                   (lse - ref_lse).abs().max().item()]
                  + [(a.float() - b).abs().max().item() for a, b in zip(grads, ref)])
        row.update(path=kind, max_error=err, ok=err < 5e-2,
                   note=f"lse {tuple(aux[0]) if aux else None} {lse.dtype}")
    except Exception as e:
        row.update(path=kind, note=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return row


def check(args, device, lengths=(2000, 2048)) -> list[dict]:
    """Outputs and input gradients of each path (`_run`) against the dense-mask float32 math
    path, bf16 inputs; s = 2000 is a multiple of 16 but not of 64 or 128 (a short last block
    and tile), 2048 is also checked where a strided plan runs (it needs whole windows). ok:
    the largest error below 2 % of the largest reference value (bf16 inputs and outputs,
    ~0.4 % per rounding)."""
    rows = [kernel_row(device), kernel_row(device, causal=True)]
    for (label, cfg), s in ((c, n) for n in lengths
                            for c in sparse_configs(args.modes, args.blocks, args.window)):
        paths = _paths(cfg.block, SparseAttention(cfg, 1, seed=0).layout(s), s, device)
        if s != lengths[0] and "strided" not in paths:
            continue
        lay = SparseAttention(cfg, args.heads, seed=0).layout(s)
        q, k, v, grad = inputs(s, args, device)
        ref = sparse_attention(q, k, v, lay, cfg.block, causal=True, backend="math")
        ref = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
        scale = max(t.float().abs().max().item() for t in ref)
        for path in paths if s == lengths[0] else ["strided"]:
            row = {"s": s, "config": label, "block": cfg.block, "path": path}
            try:
                out, plan = _run(path, q, k, v, lay, cfg.block, s)
                got = (out, *torch.autograd.grad(out, (q, k, v), grad))
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                row.update(max_error=err, rel_error=err / scale, ok=err / scale < 2e-2,
                           rect_share=rect_share(plan))
            except Exception as e:
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
    print_table(rows, ["s", "config", "block", "path", "rect_share", "max_error", "rel_error",
                       "ok", "note"])
    return rows


def dry_run(args) -> list[dict]:
    """CPU: every layout and plan of the sweep at its real sizes, then a small forward of
    each path against the dense-mask math path."""
    rows = []
    for s in args.seqs:
        for label, cfg in sparse_configs(args.modes, args.blocks, args.window):
            t0 = time.perf_counter()
            lay = layout(cfg, args.heads, s, seed=0, causal=True)
            path, _, plan, tiles, _ = prepare_path(label, lay, cfg.block, s, torch.device("cpu"))
            rows.append({"s": s, "config": label, "block": cfg.block, "path": path,
                         "density": density(lay, cfg.block, True), "tile_density": tiles,
                         "rect_share": rect_share(plan),
                         "note": f"built in {time.perf_counter() - t0:.1f} s"})
    print_table(rows, TABLE)
    small = argparse.Namespace(**{**vars(args), "heads": 2, "head_dim": 16})
    for label, cfg in sparse_configs(args.modes, args.blocks, args.window):
        lay = layout(cfg, 2, 1024, seed=0, causal=True)
        q, k, v, _ = inputs(1024, small, torch.device("cpu"), torch.float32, requires_grad=False)
        want = sparse_attention(q, k, v, lay, cfg.block, backend="math")
        mask, _ = tile_mask(lay, cfg.block, torch.device("cpu"))
        got = [sparse_attention(q, k, v, lay, cfg.block, backend="flex", block_mask=mask)]
        got += [_run(path, q, k, v, lay, cfg.block, 1024)[0]
                for path in _paths(cfg.block, lay, 1024)[1:]]
        err = max((out - want).abs().max().item() for out in got)
        assert err < 1e-4, (label, cfg.block, err)
    print("dry run: CPU FlexAttention forward, the gather plan with and without rectangles and "
          "the strided plan (float32 kernels) equal the dense-mask math path for every config")
    return rows
