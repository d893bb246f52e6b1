"""Kernel rates for the step-time model (`megazoo.plan.timing`), measured on one GPU.

    python -m bench.plan_calibration --out megazoo/plan/calibration/h100-sxm.json
    python -m bench.plan_calibration --dry-run --out /tmp/cal.json      # CPU, tiny shapes

Measures, in one process and without collectives:

- bf16 GEMMs (`torch.mm`) at the shapes of a transformer layer's four projections (q/k/v,
  attention output, MLP in, MLP out) for widths h 1024..16384, tokens per micro-batch
  2k..16k and tensor-parallel splits 1..8, each as its forward (m = tokens, n = out, k = in),
  input-gradient (m = tokens, n = in, k = out) and weight-gradient (m = out, n = in,
  k = tokens) product, deduplicated; shapes above `--max-gemm-tflop` of work are left out
  (they sit on the curve's flat top and would take the call's time);
- FP8 (e4m3, tensorwise scales, `torch._scaled_mm`) at the forward shapes of 8192 tokens;
- causal SDPA attention (the default backend: cuDNN on Hopper) forward and forward +
  backward at a few (batch, heads, sequence, head dim), issued back to back;
- a large device-to-device copy (HBM GB/s, read + write counted) and torch's fused AdamW
  over fp32 parameters (bytes per parameter per second).

Writes one JSON document (the machine's name, torch version, every measurement) that the
planner keeps as a fixture and fits its efficiency curves to (`megazoo/plan/calibration.py`).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from bench.common import time_ms

HIDDEN = (1024, 2048, 4096, 8192, 12288, 16384)
TOKENS = (2048, 4096, 8192, 16384)
TP = (1, 2, 4, 8)
ATTENTION = [  # (batch, heads, seq, head_dim)
    (4, 16, 2048, 128), (1, 32, 2048, 128), (1, 12, 2048, 128), (1, 28, 2048, 128),
    (1, 32, 4096, 128), (1, 32, 8192, 128), (1, 16, 16384, 128), (4, 16, 2048, 64),
    (1, 32, 4096, 64), (1, 20, 2048, 160),
    (4, 8, 2048, 128), (4, 4, 2048, 128), (1, 16, 4096, 128), (1, 8, 4096, 128)]  # tp 2 / 4


def layer_gemms(h: int, tokens: int, tp: int) -> set[tuple[int, int, int]]:
    """(m, n, k) of the forward, input-gradient and weight-gradient products of one layer."""
    shapes = set()
    for n_in, n_out in ((h, 3 * h // tp), (h // tp, h), (h, 4 * h // tp), (4 * h // tp, h)):
        shapes |= {(tokens, n_out, n_in), (tokens, n_in, n_out), (n_out, n_in, tokens)}
    return shapes


def gemm_grid(max_tflop: float, hidden=HIDDEN, tokens=TOKENS, tps=TP) -> list[tuple[int, int, int]]:
    """Every layer GEMM of the grid with at most `max_tflop` TFLOP of work, smallest first."""
    shapes = set()
    for h in hidden:
        for s in tokens:
            for tp in tps:
                shapes |= layer_gemms(h, s, tp)
    return sorted((s for s in shapes if 2 * math.prod(s) <= max_tflop * 1e12), key=math.prod)


def _iters(flop: float) -> int:
    """Calls per timed group: about 20 ms of work, between 3 and 50."""
    return max(3, min(50, int(20e-3 / max(flop / 600e12, 1e-6))))


def time_back_to_back(fn, calls: int, device) -> float:
    """Median ms per call over 3 groups of `calls` calls issued back to back (the launches
    queue ahead of the GPU, as in a training step), after one warm-up group."""
    return time_ms(lambda: [fn() for _ in range(calls)], device, warmup=1, iters=3) / calls


def time_gemm(m: int, n: int, k: int, device, dtype=torch.bfloat16) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return time_back_to_back(lambda: torch.mm(a, b), _iters(2.0 * m * n * k), device)


def time_fp8(m: int, n: int, k: int, device) -> float | None:
    """Tensorwise-scaled e4m3 GEMM (None where torch cannot run it here)."""
    if device.type != "cuda":
        return None
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=device)
    return time_back_to_back(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                             _iters(2.0 * m * n * k), device)


def time_attention(b: int, heads: int, s: int, d: int, device, dtype) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of causal SDPA on [b, heads, s, d], back to back:
    one call timed alone would hold the host's time between its forward's and backward's
    launches, which a training step hides behind the queued kernels."""
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(out, grad)
    calls = _iters(6.0 * b * heads * s * s * d)
    return time_back_to_back(forward, calls, device), time_back_to_back(both, calls, device)


def time_copy(numel: int, device) -> float:
    """Device-to-device copy GB/s (bytes read + written)."""
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, 2, 10)
    return 2 * 2 * numel / ms / 1e6


def time_adamw(numel: int, device) -> float:
    """Seconds per fp32 parameter of one fused AdamW step (CPU: the default implementation)."""
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=device.type == "cuda")
    return time_ms(opt.step, device, 2, 5) / 1e3 / numel


def measure(device, dry_run: bool, max_tflop: float, save) -> dict:
    """Every measurement; `save(partial)` is called after each part (a killed call keeps
    what it measured)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = gemm_grid(max_tflop) if not dry_run else gemm_grid(1e-3, (64, 128), (64,), (1, 2))
    started, gemms = time.time(), []
    for m, n, k in grid:
        ms = time_gemm(m, n, k, device, dtype)
        gemms.append(dict(m=m, n=n, k=k, ms=ms, tflops=2 * m * n * k / ms / 1e9))
    save(dict(gemm_bf16=gemms))
    fp8 = []
    for m, n, k in sorted({g for h in HIDDEN for g in layer_gemms(h, 8192, 1)
                           if g[0] == 8192} if not dry_run else set()):
        ms = time_fp8(m, n, k, device)
        if ms is not None:
            fp8.append(dict(m=m, n=n, k=k, ms=ms, tflops=2 * m * n * k / ms / 1e9))
    save(dict(gemm_bf16=gemms, gemm_fp8=fp8))
    attention = []
    for b, heads, s, d in ATTENTION if not dry_run else [(1, 2, 64, 16)]:
        fwd, both = time_attention(b, heads, s, d, device, dtype)
        attention.append(dict(batch=b, heads=heads, seq=s, head_dim=d, fwd_ms=fwd,
                              fwd_bwd_ms=both))
    numel = 2**30 if not dry_run else 2**16
    return dict(gemm_bf16=gemms, gemm_fp8=fp8, attention=attention,
                copy_gb_s=time_copy(numel, device),
                adamw_s_per_param=time_adamw(numel // 4, device),
                seconds=time.time() - started)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--max-gemm-tflop", type=float, default=4.0,
                        help="Leave out GEMMs with more work than this (TFLOP)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    head = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"))

    def save(part: dict) -> None:
        with open(args.out, "w") as f:
            json.dump({**head, **part}, f, indent=1)
    result = {**head, **measure(device, args.dry_run, args.max_gemm_tflop, save)}
    save(result)
    g = result["gemm_bf16"]
    print(f"{result['device']}: {len(g)} bf16 GEMMs in {result['seconds']:.0f} s, best "
          f"{max(x['tflops'] for x in g):.0f} TF/s; copy {result['copy_gb_s']:.0f} GB/s")


if __name__ == "__main__":
    main()
