"""One GPU: FP8 linear (megazoo/layers/fp8.py) against bf16, per GEMM shape and per block stack.

    python bench/fp8_bench.py --out fp8_bench.json          # H100 / H200, under 4 minutes
    python bench/fp8_bench.py --dry-run                     # CPU, tiny shapes: the plumbing

Part 1, linears: forward + backward of y = x W^T (dy random) for the projections of gpt-1.3b
(h 2048, ffn 8192, 8192 tokens) and of a Llama-3-8B-like layer (h 4096, qkv 6144, SwiGLU
14336 (gate+up fused: 28672), 4096 tokens): bf16 `F.linear`, and fp8 tensorwise / rowwise
with each cast implementation (eager ops, torch.compile, Triton). `gemm_only` times the three
`_scaled_mm` calls on operands cast beforehand: the ceiling a perfectly fused cast would
reach. Where torchao imports (stage it with `bash tools/gpu_stage.sh torchao==0.18.0`), a
`torchao tensorwise` row runs the same linear as torchao's `Float8Linear` (dynamic tensorwise
scaling, hybrid formats as here), compiled with `torch.compile` as torchao recommends: the
other way to build these layers. TF/s counts the 6 M K N FLOPs of the three GEMMs.

Part 2, block stacks: a 4-layer megazoo model (llama 8B-like: s 4096, b 1; gpt-1.3b-like:
s 2048, b 4), forward + backward + fused AdamW step, bf16 against the same model with an
FP8Recipe set on every Column/RowParallelLinear inside its transformer layers (embedding,
output head, norms and attention stay bf16), and with FP8 on the MLP projections only (the
large GEMMs, where the casts cost least relative to the GEMM). Tokens/s and the ratio to bf16.

Timing: CUDA events, warm-up, median (bench/common.py). Each config runs in try/except:
a failure is a row with its error, the sweep goes on.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_ms, write_json  # noqa: E402

from megazoo.config.precision import FP8Recipe  # noqa: E402
from megazoo.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megazoo.layers.fp8 import fp8_linear, scaled_mm  # noqa: E402
from megazoo.kernels.fp8_cast import quantize  # noqa: E402

LINEARS = {  # name: (tokens, in, out)
    "gpt-1.3b": [("qkv", 8192, 2048, 6144), ("proj", 8192, 2048, 2048),
                 ("fc1", 8192, 2048, 8192), ("fc2", 8192, 8192, 2048)],
    "llama-8b": [("qkv", 4096, 4096, 6144), ("o", 4096, 4096, 4096),
                 ("gate_up", 4096, 4096, 28672), ("down", 4096, 14336, 4096)],
}
STACKS = {  # name: (ModelConfig kwargs, batch, seq)
    "llama-8b": (dict(family="llama", hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, ffn_hidden_size=14336), 1, 4096),
    "gpt-1.3b": (dict(family="gpt", hidden_size=2048, num_attention_heads=16), 4, 2048),
}
TINY_LINEARS = {"tiny": [("qkv", 64, 64, 96), ("fc2", 64, 128, 64)]}
TINY_STACKS = {"tiny-llama": (dict(family="llama", hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, ffn_hidden_size=128), 2, 32)}


def linear_variants(cuda: bool) -> list[tuple[str, FP8Recipe | None]]:
    casts = ["eager", "compile", "triton"] if cuda else ["eager"]
    out = [("bf16", None)]
    for rec in ("tensorwise", "rowwise"):
        out += [(f"fp8 {rec} {c}", FP8Recipe("hybrid", rec, cast=c)) for c in casts]
        out.append((f"fp8 {rec} gemm_only", FP8Recipe("hybrid", rec)))
    if cuda and importlib.util.find_spec("torchao") is not None:
        out.append(("torchao tensorwise", FP8Recipe("hybrid")))
    return out


def _torchao_linear(w: torch.Tensor):
    """torchao's Float8Linear around `w` (tensorwise dynamic scaling, e5m2 gradients), compiled."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight = torch.nn.Parameter(w.detach().clone())
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return torch.compile(convert_to_float8_training(lin, config=config))


def _gemm_only(x, w, dy, recipe):
    """The three FP8 GEMMs of fwd + bwd on operands quantized once, outside the timing."""
    f, g, rw = recipe.fwd_dtype, recipe.grad_dtype, recipe.rowwise
    xq, ix = quantize(x, f, rw)
    wq, iw = quantize(w, f, rw)
    dyq, idy = quantize(dy, g, rw)
    wtq, iwt = quantize(w, f, rw, transpose=True)
    dytq, idyt = quantize(dy, g, rw, transpose=True)
    xtq, ixt = quantize(x, f, rw, transpose=True)
    row = lambda s: s.reshape(1, -1) if s.dim() else s  # noqa: E731

    def run():
        scaled_mm(xq, wq.t(), ix, row(iw), x.dtype, False, True)
        scaled_mm(dyq, wtq.t(), idy, row(iwt), x.dtype, False)
        scaled_mm(dytq, xtq.t(), idyt, row(ixt), x.dtype, False)
    return run


def bench_linear(m, k, n, recipe, label, device, iters) -> float:
    dtype = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5).requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=dtype)
    if label.endswith("gemm_only"):
        fn = _gemm_only(x.detach(), w.detach(), dy, recipe)
    elif label.startswith("torchao"):
        lin = _torchao_linear(w)

        def fn():
            lin(x).backward(dy)
            x.grad = lin.weight.grad = None
    else:
        def fn():
            fp8_linear(x, w, None, recipe).backward(dy)
            x.grad = w.grad = None
    return time_ms(fn, device, warmup=3, iters=iters)


def run_linears(shapes, device, iters, only=None) -> list[dict]:
    """Every GEMM shape x variant (those whose name holds one of `only`'s words, and bf16)."""
    rows = []
    for model, layers in shapes.items():
        for name, m, k, n in layers:
            base = None
            for label, recipe in linear_variants(device.type == "cuda"):
                if only and recipe is not None and not any(w in label for w in only):
                    continue
                row = dict(model=model, gemm=name, mkn=f"{m}x{k}x{n}", variant=label)
                try:
                    ms = bench_linear(m, k, n, recipe, label, device, iters)
                    base = ms if recipe is None else base
                    row.update(ms=ms, tflops=6 * m * k * n / ms / 1e9,
                               speedup=base / ms if base else None)
                except Exception as exc:  # report and go on: one broken config is a row
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(row)
    return rows


def set_fp8(model: torch.nn.Module, recipe: FP8Recipe | None, mlp_only: bool = False) -> int:
    """Give the Column/RowParallelLinear layers of the transformer layers `recipe` (only
    those of the MLPs with `mlp_only`); returns how many."""
    count = 0
    for name, module in model.layers.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if mlp_only and ".mlp." not in f".{name}.":
                continue
            module.fp8, count = recipe, count + 1
    return count


def bench_stack(kwargs, batch, seq, layers, recipe, device, iters, mlp_only=False) -> dict:
    from megazoo.models import ModelConfig, build_model

    cfg = ModelConfig(num_layers=layers, vocab_size=32000, max_position_embeddings=seq,
                      **kwargs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_model(cfg, state=None, device=device, dtype=dtype, seed=0)
    n_fp8 = set_fp8(model, recipe, mlp_only)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step():
        model(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ms = time_ms(step, device, warmup=3, iters=iters)
    out = dict(step_ms=ms, tokens_per_s=batch * seq / ms * 1e3, fp8_linears=n_fp8 if recipe else 0)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_stacks(stacks, layers, device, iters) -> list[dict]:
    rows = []
    tensorwise, rowwise = FP8Recipe("hybrid", "tensorwise"), FP8Recipe("hybrid", "rowwise")
    variants = [("bf16", None, False), ("fp8 tensorwise", tensorwise, False),
                ("fp8 rowwise", rowwise, False), ("fp8 tensorwise, MLP only", tensorwise, True)]
    for name, (kwargs, batch, seq) in stacks.items():
        base = None
        for label, recipe, mlp_only in variants:
            row = dict(model=name, layers=layers, tokens=batch * seq, variant=label)
            try:
                row.update(bench_stack(kwargs, batch, seq, layers, recipe, device, iters,
                                       mlp_only))
                base = row["tokens_per_s"] if recipe is None else base
                row["vs_bf16"] = row["tokens_per_s"] / base if base else None
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, emulation")
    p.add_argument("--parts", nargs="+", default=["linears", "stacks"],
                   choices=["linears", "stacks"])
    p.add_argument("--layers", type=int, default=4, help="layers of the block stacks")
    p.add_argument("--models", nargs="+", default=None, help="linears of these models only")
    p.add_argument("--variants", nargs="+", default=None,
                   help="linear variants whose name holds one of these (bf16 always runs)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("fp8_bench.py needs a CUDA GPU with FP8 tensor cores; use --dry-run on CPU",
              file=sys.stderr)
        sys.exit(2)
    iters = 2 if args.dry_run else args.iters
    linears, stacks = (TINY_LINEARS, TINY_STACKS) if args.dry_run else (LINEARS, STACKS)
    result = dict(env=environment(device), linears=[], stacks=[])
    if "linears" in args.parts:
        if args.models and not args.dry_run:
            linears = {m: linears[m] for m in args.models}
        result["linears"] = run_linears(linears, device, iters, args.variants)
        print_table(result["linears"], ["model", "gemm", "mkn", "variant", "ms", "tflops",
                                        "speedup", "error"])
    if "stacks" in args.parts:
        layers = 2 if args.dry_run else args.layers
        result["stacks"] = run_stacks(stacks, layers, device, iters)
        print_table(result["stacks"], ["model", "layers", "tokens", "variant", "step_ms",
                                       "tokens_per_s", "vs_bf16", "fp8_linears", "error"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
