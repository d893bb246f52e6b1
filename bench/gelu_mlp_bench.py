"""The GELU MLP with its bias, GELU and GELU derivative inside the GEMMs (cuBLASLt epilogues,
`megazoo/layers/gelu_mlp.py`) against the same `ParallelMLP` with `bias_gelu_fusion=False`.

    python -m bench.gelu_mlp_bench --out gelu_mlp.json    # one GPU, seconds
    python -m bench.gelu_mlp_bench --dry-run              # CPU: the code path (both unfused)

Columns (milliseconds, median of CUDA-event-timed calls, bench/README.md conventions): one
forward, and one forward + backward (input and all four parameter gradients), bf16, for
[s, b, h] input at M = s b tokens; `diff` = max |fused - unfused| over max |unfused| of the
output and every gradient (both are bf16 computations; the fused one rounds less often).
Shapes (M, h, ffn): gpt-1.3b's and gpt-350m's MLP at s 2048, micro-batch 4.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import environment, print_table, time_ms, write_json
from megazoo.layers import ParallelMLP

SHAPES = [(8192, 2048, 8192), (8192, 1024, 4096)]


def _mlp(h: int, ffn: int, fusion: bool, device, dtype) -> ParallelMLP:
    torch.manual_seed(0)
    mlp = ParallelMLP(h, ffn, group=None, bias_gelu_fusion=fusion).to(device, dtype)
    with torch.no_grad():
        mlp.fc1.bias.normal_(std=0.1)
        mlp.fc2.bias.normal_(std=0.1)
    return mlp


def _results(mlp: ParallelMLP, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    xi = x.detach().requires_grad_()
    y = mlp(xi)
    y.backward(dy)
    out = [y.detach(), xi.grad] + [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    return out


def shape_row(m: int, h: int, ffn: int, device: torch.device, dtype) -> dict:
    x = torch.randn(m // 4, 4, h, device=device, dtype=dtype)
    dy = torch.randn(m // 4, 4, h, device=device, dtype=dtype)
    row = {"M": m, "h": h, "ffn": ffn}
    results = {}
    for name, fusion in (("fused", True), ("unfused", False)):
        mlp = _mlp(h, ffn, fusion, device, dtype)
        xi = x.detach().requires_grad_()
        with torch.no_grad():
            row[f"fwd_{name}"] = time_ms(lambda: mlp(x), device)

        def step():
            mlp(xi).backward(dy)
            mlp.zero_grad(set_to_none=True)  # (no gradient accumulation inside the timing)
            xi.grad = None

        row[f"fwd_bwd_{name}"] = time_ms(step, device)
        results[name] = _results(mlp, x, dy)
    row["diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                      for a, b in zip(results["fused"], results["unfused"]))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="a small shape on CPU, float32")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(64, 32, 128)] if device.type == "cpu" else SHAPES
    rows = [shape_row(m, h, ffn, device, dtype) for m, h, ffn in shapes]
    print_table(rows, ["M", "h", "ffn", "fwd_fused", "fwd_unfused", "fwd_bwd_fused",
                       "fwd_bwd_unfused", "diff"])
    write_json(args.out, {"environment": environment(device), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
