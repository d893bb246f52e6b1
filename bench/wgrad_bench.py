"""Gradient-accumulation fusion, one weight-gradient GEMM at a time: unfused (dW in the
model's dtype, then added into the fp32 main gradient) against fused (the GEMM accumulates
into it), bf16 and FP8, with each fused result's error against float64.

    python -m bench.wgrad_bench --out wgrad.json     # one GPU, under a minute
    python -m bench.wgrad_bench --dry-run            # CPU: the bf16 rows' code path

Columns (milliseconds, median of CUDA-event-timed calls, bench/README.md conventions):
`bf16_unfused` = `main.add_(dy^T @ x)`, `bf16_fused` = `wgrad.accumulate_wgrad` (addmm with
an fp32 output, beta = 1), `fp8_unfused` = `_scaled_mm` to bf16 then `add_`, `fp8_fused` =
`cublaslt.fp8_gemm_accumulate` (beta = 1); `*_err` = max |fused - float64| over max |float64|.
Shapes (M tokens, K in, N out): the Llama-8B-like layer's MLP GEMMs and gpt-1.3b's.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from bench.common import environment, print_table, time_ms, write_json
from megazoo.kernels.cublaslt import fp8_gemm_accumulate
from megazoo.layers.wgrad import accumulate_wgrad

SHAPES = [(4096, 4096, 14336), (4096, 14336, 4096), (8192, 2048, 6144), (8192, 2048, 8192),
          (8192, 8192, 2048)]


def _fused_weight(n: int, k: int, device, dtype) -> nn.Parameter:
    """A weight whose owner fuses its gradient (the contract in megazoo.layers.wgrad)."""
    w = nn.Parameter(torch.empty(n, k, device=device, dtype=dtype))
    w.main_grad = torch.zeros(n, k, device=device)
    w.fuse_wgrad, w.main_grad_fresh, w.grad_added_to_main_grad = True, True, False
    return w


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def shape_row(m: int, k: int, n: int, device: torch.device, fp8: bool) -> dict:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    w = _fused_weight(n, k, device, torch.bfloat16)
    row = {"M": m, "K": k, "N": n,
           "bf16_unfused": time_ms(lambda: w.main_grad.add_(dy.t() @ x), device),
           "bf16_fused": time_ms(lambda: accumulate_wgrad(w, dy, x), device)}
    w.main_grad_fresh = True
    accumulate_wgrad(w, dy, x)
    row["bf16_err"] = _relative_error(w.main_grad, dy.double().t() @ x.double())
    if fp8:
        xt = (x.float() * 64).to(torch.float8_e4m3fn).t().contiguous()       # x^T [K, M]
        dyt = (dy.float() * 4096).to(torch.float8_e5m2).t().contiguous()     # dy^T [N, M]
        inv_x, inv_dy = (torch.tensor(1 / s, device=device) for s in (64.0, 4096.0))
        main = w.main_grad

        def unfused():
            main.add_(torch._scaled_mm(dyt, xt.t(), scale_a=inv_dy, scale_b=inv_x,
                                       out_dtype=torch.bfloat16))

        row["fp8_unfused"] = time_ms(unfused, device)
        row["fp8_fused"] = time_ms(lambda: fp8_gemm_accumulate(dyt, xt, inv_dy, inv_x, main, True),
                                   device)
        if not fp8_gemm_accumulate(dyt, xt, inv_dy, inv_x, main, False):
            raise RuntimeError("cuBLASLt's FP8 accumulation did not run on this device")
        want = (dyt.double() @ xt.double().t()) / 64 / 4096
        row["fp8_err"] = _relative_error(main, want)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="small shapes on CPU, bf16 only")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    shapes = [(64, 32, 48)] if device.type == "cpu" else SHAPES
    rows = [shape_row(m, k, n, device, fp8) for m, k, n in shapes]
    cols = ["M", "K", "N", "bf16_unfused", "bf16_fused", "bf16_err", "fp8_unfused", "fp8_fused",
            "fp8_err"]
    print_table(rows, cols)
    write_json(args.out, {"environment": environment(device), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
