"""One GPU: does the memory layout of q, k, v cost causal SDPA time? (input to Ulysses tuning)

    python -m bench.sdpa_layout_bench --seqs 32768 65536 131072 --heads 16 --out layout.json

Ulysses' local attention sees the full sequence of H/sp heads in the layout the all-to-all
delivers, not the [b, h, s, d] layout a single-GPU baseline allocates. For each sequence
length this times forward + backward of causal SDPA (bf16, head_dim 128, batch 1) on:

| layout | what |
|---|---|
| bhsd | contiguous [b, h, s, d] (the single-GPU baseline) |
| fused_sbh3d | views of one [s, b, h, 3, d] buffer (megazoo's fused all-to-all output) |
| sbhd | three contiguous [s, b, h, d] tensors (DeepSpeed's all-to-all outputs) |
| fused_copy | fused_sbh3d copied to contiguous [b, h, s, d] before SDPA (copy timed too) |
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import print_table, time_cuda, write_json


def layouts(s: int, h: int, d: int, device, dtype) -> dict:
    """name -> (leaf tensors, function building [b, h, s, d] q, k, v from them)."""
    fused = torch.randn(s, 1, h, 3, d, device=device, dtype=dtype, requires_grad=True)
    sbhd = [torch.randn(s, 1, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    bhsd = [torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    views = lambda: [t.permute(1, 2, 0, 3) for t in fused.unbind(3)]  # noqa: E731
    return {
        "bhsd": ([*bhsd], lambda: bhsd),
        "fused_sbh3d": ([fused], views),
        "sbhd": ([*sbhd], lambda: [t.permute(1, 2, 0, 3) for t in sbhd]),
        "fused_copy": ([fused], lambda: [t.contiguous() for t in views()]),
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for s in args.seqs:
        row = {"seq": s}
        for name, (leaves, build) in layouts(s, args.heads, args.head_dim, "cuda", torch.bfloat16).items():
            grad = torch.randn(1, args.heads, s, args.head_dim, device="cuda", dtype=torch.bfloat16)

            def step():
                q, k, v = build()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, leaves, grad)
            row[f"{name}_ms"] = 1e3 * time_cuda(step, warmup=3, iters=10)
        base = row["bhsd_ms"]
        for name in ("fused_sbh3d", "sbhd", "fused_copy"):
            row[f"{name}_vs_bhsd"] = row[f"{name}_ms"] / base
        rows.append(row)
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
