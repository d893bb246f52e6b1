"""ALiBi attention (BLOOM-like) forward+backward through every available backend, one GPU.

    python -m bench.attention_bench --out attention.json          # GPU: 16 heads x 128, bf16
    python -m bench.attention_bench --dry-run                     # CPU, tiny, exercises the code

For each (sequence, batch): median fwd+bwd time of each backend (math, sdpa with a
materialised bias, flex, flash when installed) and of "auto", the error of each against the
float32 math reference (or against flex where math does not fit in memory), and whether auto
chose the fastest backend whose error is within bf16 rounding. Causal attention FLOPs counted
as 7 b h s^2 d (forward 2 b h s^2 d for the two causal matmuls, backward 2.5x that).
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, print_table, time_ms, write_json
from megazoo.layers import alibi_slopes, core_attention
from megazoo.layers.attention import AttentionRequest, select_backend, unsupported_reason

BACKENDS = ("math", "sdpa", "flex", "flash")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tolerance", type=float, default=2e-2,
                   help="max error relative to the largest reference output for 'exact'")
    p.add_argument("--dry-run", action="store_true", help="tiny float32 run on CPU")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.seqs, args.batches = "cpu", [64, 128], [1, 2]
        args.heads, args.head_dim, args.warmup, args.iters = 6, 16, 1, 2
    return args


def _inputs(s, b, args, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(s, b, args.heads, args.head_dim, device=device, generator=g, dtype=dtype)
               .requires_grad_() for _ in range(3))
    return q, k, v, torch.randn_like(q), alibi_slopes(args.heads, device=device)


def _run_one(name, inputs, device, args):
    """(median ms, output) of fwd+bwd through `name`, or (reason string, None)."""
    q, k, v, grad, slopes = inputs

    def step():
        out = core_attention(q, k, v, alibi_slopes=slopes, backend=name)
        torch.autograd.grad(out, (q, k, v), grad)
        return out
    try:
        ms = time_ms(step, device, args.warmup, args.iters)
        with torch.no_grad():
            out = core_attention(q, k, v, alibi_slopes=slopes, backend=name)
        return ms, out
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return "out of memory", None


def bench_shape(s, b, args, device, dtype) -> list[dict]:
    inputs = _inputs(s, b, args, device, dtype)
    req = AttentionRequest(device.type, dtype, args.head_dim, alibi=True, padding=False,
                           dropout=False, requires_grad=True)
    rows, outputs = [], {}
    for name in BACKENDS + ("auto",):
        reason = unsupported_reason(name, req) if name != "auto" else None
        ms, out = (reason, None) if reason else _run_one(name, inputs, device, args)
        row = {"seq": s, "batch": b, "backend": name}
        if isinstance(ms, float):
            flops = 7 * b * args.heads * s * s * args.head_dim
            row.update(ms=ms, tflops=flops / ms / 1e9)
            outputs[name] = out
        else:
            row["note"] = ms
        rows.append(row)
    ref_name = "math" if "math" in outputs else "flex"
    ref = outputs.get(ref_name)
    for row in rows:
        out = outputs.get(row["backend"])
        if ref is not None and out is not None:
            err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
            row.update(err=err, exact=err <= args.tolerance, vs=ref_name)
    auto = select_backend("auto", req)
    timed = [r for r in rows if r["backend"] in BACKENDS and r.get("exact")]
    fastest = min(timed, key=lambda r: r["ms"])["backend"] if timed else None
    for row in rows:
        if row["backend"] == "auto":
            row.update(chose=auto, fastest=fastest, auto_is_fastest=auto == fastest)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = []
    for s in args.seqs:
        for b in args.batches:
            rows += bench_shape(s, b, args, device, dtype)
    print_table(rows, ["seq", "batch", "backend", "ms", "tflops", "err", "exact", "note",
                       "chose", "fastest"])
    autos = [r for r in rows if r["backend"] == "auto"]
    ok = all(r.get("auto_is_fastest") for r in autos)
    print(f"auto chose the fastest exact backend in {sum(bool(r.get('auto_is_fastest')) for r in autos)}"
          f"/{len(autos)} shapes")
    write_json(args.out, {"env": environment(device), "args": vars(args), "rows": rows,
                          "auto_is_fastest_everywhere": ok})
    return 0


if __name__ == "__main__":
    sys.exit(main())
