"""Block-sparse attention (FlexAttention from a layout) against dense causal attention, one GPU.

    python -m bench.sparse_attention_bench --out sparse.json     # the sweep (GPU)
    python -m bench.sparse_attention_bench --check                # sparse vs dense-mask math
    python -m bench.sparse_attention_bench --dry-run              # CPU: every layout and mask

Forward + backward of causal attention, 16 heads x 128, bf16, batch 1, at s = 32k and 64k:
dense SDPA (cuDNN's fused kernel), dense FlexAttention (causal BlockMask), and the sparse
path (`megazoo.layers.sparse_attention`, backend "auto": the gather plan where it computes
fewer tiles, else the layout's own tiles) for fixed, variable, bigbird and bslongformer
layouts at block 16, 64 and 128 with a causal window of about --window tokens, plus the
seeds' section (fixed, block 16, DeepSpeed's defaults), and `seeds_tiles`: the same section
on the layout's own tiles (the path before the gather plan). For each: median ms (CUDA
events), the layout's density (fraction of s^2 computed), the density of the 128-token tiles
the kernel computes (`tile_density`, of (s/128)^2 per head), the path, and the speedup
against SDPA and dense FlexAttention.

Each configuration runs in its own try/except (a failure is a row with the error); FlexAttention
is compiled once per process (recompiling per sequence length and layout shape).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import environment, print_table, time_ms, write_json
from megazoo.config.sparse_attention import SparseAttentionConfig
from megazoo.layers import core_attention
from megazoo.layers.sparse_attention import (SparseAttention, block_mask_from_layout, choose_plan,
                                             sparse_attention)
from megazoo.layers.sparse_gather import block_masks
from megazoo.layers.sparse_plan import build_plan
from megazoo.layers.sparse_layouts import density, layout

COLUMNS = ["s", "config", "block", "path", "density", "tile_density", "ms", "x_sdpa", "x_flex",
           "note"]
MODES = ["seeds", "bslongformer", "bigbird", "fixed", "variable"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--modes", nargs="+", default=MODES, help=f"of {MODES + ['seeds_tiles']}")
    p.add_argument("--window", type=int, default=256, help="causal window in tokens (approx.)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="skip the remaining configurations after this many seconds")
    p.add_argument("--check", action="store_true",
                   help="compare sparse outputs and gradients with dense-mask math, small s")
    p.add_argument("--with-check", action="store_true", help="the --check, then the sweep")
    p.add_argument("--compare", nargs="*", default=[], metavar="MODE",
                   help="these modes at blocks below 128 also on the other path, first length")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: build every layout and BlockMask at the real sizes, no attention")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def sparse_configs(modes, blocks, window) -> list[tuple[str, SparseAttentionConfig]]:
    """(label, config) for each mode and block: a causal window of about `window` tokens
    (fixed and variable: windows of 2 * window tokens, one global block per window / block 0)."""
    out = []
    for mode in modes:
        if mode in ("seeds", "seeds_tiles"):  # the seeds' ds_config section, DeepSpeed's defaults
            keys = {"mode": "fixed", "block": 16, "different_layout_per_head": True}
            out.append((mode, SparseAttentionConfig.from_ds_config(keys)))
            continue
        for block in blocks:
            back = max(1, window // block)  # key blocks before the diagonal one
            keys = {"mode": mode, "block": block, "different_layout_per_head": True,
                    "attention": "unidirectional"}
            if mode == "fixed":
                keys.update(num_local_blocks=max(1, 2 * window // block), num_global_blocks=1)
            elif mode == "variable":
                keys.update(local_window_blocks=[max(1, 2 * window // block)], num_random_blocks=1,
                            global_block_indices=[0])
            elif mode == "bigbird":
                keys.update(num_sliding_window_blocks=2 * back + 1, num_global_blocks=1,
                            num_random_blocks=1)
            else:
                keys.update(num_sliding_window_blocks=2 * back + 1, global_block_indices=[0])
            out.append((f"{mode}", SparseAttentionConfig.from_ds_config(keys)))
    return out


def _inputs(s, args, device, dtype=torch.bfloat16, requires_grad=True):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (s, 1, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_(requires_grad)
               for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype, generator=g)


def _step(fn, q, k, v, grad):
    def step():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)
    return step


def _mask(lay, block, device):
    """The BlockMask, and the fraction of 128-token tiles it computes (of all s^2 tiles).

    Every layout is looked up at 16-token granularity (the same mask), so that all blocks
    share one compiled kernel per sequence length."""
    mask = block_mask_from_layout(lay, block, causal=True, device=device, lookup_block=16)
    tiles = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    return mask, tiles.item() / mask.kv_indices.shape[-2] ** 2 / mask.kv_indices.shape[1]


def _prepare(label, lay, block, s, device):
    """(path, block_mask, plan, tile density): what backend "auto" runs, or the path a label
    ending in _tiles / _gather names, built once; tile density as computed tiles / ((s/128)^2
    heads)."""
    if label.endswith("_gather"):
        plan = build_plan((lay[:1] if lay.stride(0) == 0 else lay).to(device), block, s, True)
    else:
        plan = None if label.endswith("_tiles") else choose_plan(lay, block, True, s, device)
    if plan is None:
        mask, tiles = _mask(lay, block, device)
        return "tiles", mask, None, tiles
    block_masks(plan)
    n = plan.partial.shape[1]
    return "gather", None, plan, sum(plan.tiles()) / (n * n * plan.heads)


def dense_rows(s, inputs, args, device) -> list[dict]:
    """Dense causal SDPA (cuDNN) and dense causal FlexAttention at one length."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return core_attention(q, k, v, causal=True, backend="sdpa")

    def flex(q, k, v):
        return core_attention(q, k, v, causal=True, backend="flex")

    rows = []
    for name, fn in (("dense_sdpa_cudnn", sdpa), ("dense_flex", flex)):
        row = {"s": s, "config": name, "block": None, "density": (s + 1) / (2 * s)}
        try:
            row["ms"] = time_ms(_step(fn, *inputs), device, args.warmup, args.iters)
        except Exception as e:  # one failure must not lose the sweep
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows.append(row)
    return rows


def sparse_row(s, label, cfg, inputs, args, device) -> dict:
    row = {"s": s, "config": label, "block": cfg.block, "keys": cfg.to_ds_config()}
    try:
        lay = layout(cfg, args.heads, s, seed=0, causal=True)
        row["density"] = density(lay, cfg.block, True)
        t0 = time.perf_counter()
        row["path"], mask, plan, row["tile_density"] = _prepare(label, lay, cfg.block, s, device)
        row["build_s"] = time.perf_counter() - t0

        def fn(q, k, v):  # the layout is only shape-checked: the mask / plan carries it
            return sparse_attention(q, k, v, lay, cfg.block, causal=True, block_mask=mask,
                                    plan=plan)
        t0 = time.perf_counter()
        fn(*inputs[:3]).sum().backward()  # compiles
        row["compile_s"] = time.perf_counter() - t0
        row["ms"] = time_ms(_step(fn, *inputs), device, args.warmup, args.iters)
    except Exception as e:
        row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def allow_recompiles(limit: int = 256) -> None:
    """Let the compiled FlexAttention recompile per sequence length and layout shape (a sweep
    expects one compile each) instead of falling back to eager FlexAttention at dynamo's limit."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)


def sweep(args, device) -> list[dict]:
    """Dense rows, then each config on the path "auto" takes; the --compare modes, at the
    first length, also on the other path (a label ending in _tiles or _gather)."""
    allow_recompiles()
    start, rows = time.perf_counter(), []
    configs = sparse_configs(args.modes, args.blocks, args.window)
    for s in args.seqs:
        inputs = _inputs(s, args, device)
        here = dense_rows(s, inputs, args, device)
        for label, cfg in configs:
            if time.perf_counter() - start > args.budget_s:
                here.append({"s": s, "config": label, "block": cfg.block, "note": "skipped: --budget-s"})
                continue
            here.append(sparse_row(s, label, cfg, inputs, args, device))
            other = {"gather": "tiles", "tiles": "gather"}.get(here[-1].get("path"))
            if label in args.compare and s == args.seqs[0] and cfg.block < 128:
                here.append(sparse_row(s, f"{label}_{other}", cfg, inputs, args, device))
            torch.cuda.empty_cache()
        _speedups(here)
        rows += here
        print_table(here, COLUMNS)
        del inputs
    return rows


def _speedups(rows) -> None:
    base = {r["config"]: r.get("ms") for r in rows if r["config"].startswith("dense")}
    for r in rows:
        if r.get("ms"):
            if base.get("dense_sdpa_cudnn"):
                r["x_sdpa"] = base["dense_sdpa_cudnn"] / r["ms"]
            if base.get("dense_flex"):
                r["x_flex"] = base["dense_flex"] / r["ms"]


def check(args, device, s=2000) -> list[dict]:
    """Outputs and input gradients of the path each config runs at 128-token tiles (flex) and,
    for blocks below 128, over gathered keys, against the dense-mask float32 math path; s =
    2000 is a multiple of 16 but not of 64 or 128 (a short last block and tile)."""
    rows = []
    for label, cfg in sparse_configs(args.modes, args.blocks, args.window):
        paths = ["flex"] + (["gather"] if 128 % cfg.block == 0 and cfg.block < 128 else [])
        lay = SparseAttention(cfg, args.heads, seed=0).layout(s)
        q, k, v, grad = _inputs(s, args, device)
        ref = sparse_attention(q, k, v, lay, cfg.block, causal=True, backend="math")
        ref = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
        scale = max(t.float().abs().max().item() for t in ref)
        for path in paths:
            row = {"s": s, "config": label, "block": cfg.block, "path": path}
            try:
                out = sparse_attention(q, k, v, lay, cfg.block, causal=True, backend=path)
                got = (out, *torch.autograd.grad(out, (q, k, v), grad))
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                row.update(max_error=err, rel_error=err / scale, ok=err / scale < 2e-2)
            except Exception as e:
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
    print_table(rows, ["s", "config", "block", "path", "max_error", "rel_error", "ok", "note"])
    return rows


def dry_run(args) -> list[dict]:
    """CPU: every layout and BlockMask of the sweep at its real sizes, then a tiny forward."""
    rows = []
    for s in args.seqs:
        for label, cfg in sparse_configs(args.modes, args.blocks, args.window):
            t0 = time.perf_counter()
            lay = layout(cfg, args.heads, s, seed=0, causal=True)
            path, _, _, tiles = _prepare(label, lay, cfg.block, s, torch.device("cpu"))
            rows.append({"s": s, "config": label, "block": cfg.block, "path": path,
                         "density": density(lay, cfg.block, True), "tile_density": tiles,
                         "note": f"built in {time.perf_counter() - t0:.1f} s"})
    print_table(rows, COLUMNS)
    small = argparse.Namespace(**{**vars(args), "heads": 2, "head_dim": 16})
    for label, cfg in sparse_configs(args.modes, args.blocks, args.window):
        lay = layout(cfg, 2, 1024, seed=0, causal=True)
        q, k, v, _ = _inputs(1024, small, torch.device("cpu"), torch.float32, requires_grad=False)
        mask, _ = _mask(lay, cfg.block, torch.device("cpu"))
        err = (sparse_attention(q, k, v, lay, cfg.block, backend="flex", block_mask=mask)
               - sparse_attention(q, k, v, lay, cfg.block, backend="math")).abs().max().item()
        assert err < 1e-4, (label, cfg.block, err)
    print("dry run: CPU FlexAttention forward equals the dense-mask math path for every config")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        write_json(args.out, {"dry_run": dry_run(args), "args": vars(args)})
        return 0
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU; use --dry-run on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    payload = {"env": environment(device), "args": vars(args)}
    if args.check or args.with_check:
        payload["check"] = check(args, device)
    if not args.check:
        payload["rows"] = sweep(args, device)
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
