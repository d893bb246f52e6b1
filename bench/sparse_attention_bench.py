"""Block-sparse attention (FlexAttention from a layout) against dense causal attention, one GPU.

    python -m bench.sparse_attention_bench --out sparse.json     # the sweep (GPU)
    python -m bench.sparse_attention_bench --check                # sparse vs dense-mask math
    python -m bench.sparse_attention_bench --dry-run              # CPU: every layout and mask

Forward + backward of causal attention, 16 heads x 128, bf16, batch 1, at s = 32k and 64k:
dense SDPA (cuDNN's fused kernel), dense FlexAttention (causal BlockMask), and the sparse
path (`megazoo.layers.sparse`, backend "auto": the strided plan for windows with
global columns (path "strided": one cuDNN causal call, and the local part and the merging on
the Triton kernel below block 128, on FlexAttention at 128), else below block 128 the Triton
kernel (path "blocks"), else at 128 the layout's own tiles) for fixed, variable, bigbird and
bslongformer layouts at block 16, 64 and 128 with a causal window of about --window tokens,
plus the seeds' section (fixed, block 16, DeepSpeed's defaults) and, for comparison, the same
section on the paths before: `seeds_flexlocal` (the strided plan's local part on
FlexAttention), `seeds_rects` (the gather plan with its cuDNN rectangles), `seeds_gather`
(without them) and `seeds_tiles` (the layout's own tiles). For each: median ms (CUDA
events), the layout's density (fraction of s^2 computed), the density of the 128-token tiles
computed (`tile_density`, of (s/128)^2 per head; for the Triton kernel the share of s^2 its
chunks compute), the share of them the rectangles compute (`rect_share`), the path, and the
speedup against SDPA and dense FlexAttention. `--check` (`sparse_attention_check.py`) checks
each path, rectangles and the Triton kernel included, against the dense-mask float32 path.

Each configuration runs in its own try/except (a failure is a row with the error); FlexAttention
is compiled once per process (recompiling per sequence length and layout shape).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.common import environment, print_table, time_ms, write_json
from bench.sparse_attention_check import check, dry_run
from bench.sparse_setup import (MODES, allow_recompiles, inputs, prepare_path, rect_share,
                                sparse_configs)
from megazoo.layers import core_attention
from megazoo.layers.sparse import sparse_attention
from megazoo.layers.sparse.layouts import density, layout
from megazoo.layers.sparse.strided import strided_attention

COLUMNS = ["s", "config", "block", "path", "density", "tile_density", "rect_share", "ms",
           "x_sdpa", "x_flex", "note"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--modes", nargs="+", default=MODES,
                   help=f"of {MODES + ['seeds_tiles', 'seeds_gather', 'seeds_rects']} "
                        "and seeds_c32, seeds_flexlocal "
                        "(_cN: rectangles over about N query chunks; _flexlocal: the strided "
                        "plan's local part on FlexAttention)")
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
    p.add_argument("--profile", action="store_true",
                   help="after timing each rectangle row of the first length, print its top "
                        "operators (torch.profiler)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: build every layout and BlockMask at the real sizes, no attention")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def _step(fn, q, k, v, grad):
    def step():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)
    return step


def dense_rows(s, data, args, device) -> list[dict]:
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
            row["ms"] = time_ms(_step(fn, *data), device, args.warmup, args.iters)
        except Exception as e:  # one failure must not lose the sweep
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows.append(row)
    return rows


def sparse_row(s, label, cfg, data, args, device) -> dict:
    row = {"s": s, "config": label, "block": cfg.block, "keys": cfg.to_ds_config()}
    try:
        lay = layout(cfg, args.heads, s, seed=0, causal=True)
        row["density"] = density(lay, cfg.block, True)
        t0 = time.perf_counter()
        row["path"], mask, plan, row["tile_density"], row["why"] = prepare_path(
            label, lay, cfg.block, s, device, args.head_dim)
        row["rect_share"] = rect_share(plan)
        row["build_s"] = time.perf_counter() - t0

        def fn(q, k, v):  # the layout is only shape-checked: the mask / plan carries it
            if row["path"] == "strided_flex":
                return strided_attention(q, k, v, plan, scale=q.shape[-1] ** -0.5)
            return sparse_attention(q, k, v, lay, cfg.block, causal=True, block_mask=mask,
                                    plan=plan)
        t0 = time.perf_counter()
        fn(*data[:3]).sum().backward()  # compiles
        row["compile_s"] = time.perf_counter() - t0
        row["ms"] = time_ms(_step(fn, *data), device, args.warmup, args.iters)
        if args.profile and s == args.seqs[0] and row["path"] in ("rects", "strided"):
            row["profile"] = profile(_step(fn, *data), f"{label} s={s}")
    except Exception as e:
        row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def profile(step, title: str, steps: int = 2, top: int = 12) -> list[dict]:
    """The `top` operators by CUDA time over `steps` steps (torch.profiler), printed and
    returned as rows (name, CUDA ms per step, CPU ms per step, calls per step)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cpu_ms = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"--- profile {title}: per step, CPU total {cpu_ms:.2f} ms")
    print(events.table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))
    key = ("self_device_time_total" if hasattr(events[0], "self_device_time_total")
           else "self_cuda_time_total")  # the name differs across torch versions
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "cuda_ms": getattr(e, key) / steps / 1e3,
             "cpu_ms": e.self_cpu_time_total / steps / 1e3, "calls": e.count / steps}
            for e in ranked]


def sweep(args, device) -> list[dict]:
    """Dense rows, then each config on the path "auto" takes; the --compare modes, at the
    first length, also on the other path (a label ending in _tiles or _gather)."""
    allow_recompiles()
    start, rows = time.perf_counter(), []
    configs = sparse_configs(args.modes, args.blocks, args.window)
    for s in args.seqs:
        data = inputs(s, args, device)
        here = dense_rows(s, data, args, device)
        for label, cfg in configs:
            if time.perf_counter() - start > args.budget_s:
                here.append({"s": s, "config": label, "block": cfg.block, "note": "skipped: --budget-s"})
                continue
            here.append(sparse_row(s, label, cfg, data, args, device))
            other = {"gather": "tiles", "tiles": "gather", "rects": "gather",
                     "strided": "rects", "blocks": "tiles"}.get(here[-1].get("path"))
            if label in args.compare and s == args.seqs[0] and cfg.block < 128:
                here.append(sparse_row(s, f"{label}_{other}", cfg, data, args, device))
            torch.cuda.empty_cache()
        _speedups(here)
        rows += here
        print_table(here, COLUMNS)
        del data
    return rows


def _speedups(rows) -> None:
    base = {r["config"]: r.get("ms") for r in rows if r["config"].startswith("dense")}
    for r in rows:
        if r.get("ms"):
            if base.get("dense_sdpa_cudnn"):
                r["x_sdpa"] = base["dense_sdpa_cudnn"] / r["ms"]
            if base.get("dense_flex"):
                r["x_flex"] = base["dense_flex"] / r["ms"]


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
