"""Fused kernels vs PyTorch eager and torch.compile, forward and forward+backward, in one run.

    python -m bench.kernels_bench --out kernels.json          # one GPU, well under 4 minutes
    python -m bench.kernels_bench --device cpu --small        # dry run of every code path

For every kernel and implementation (``triton``, ``cuda`` where one exists, ``eager`` = the
PyTorch fallback run eagerly, ``compile`` = ``torch.compile`` of that same fallback, and
``native`` where PyTorch has its own fused op of the same function) it reports the median
time of the forward and of forward+backward (forward with autograd recording, then
``torch.autograd.grad``), and the achieved bandwidth: bytes of every full tensor read or
written once (inputs, outputs, saved tensors reread in the backward; small vectors such
as weights ignored), over time. ``%copy`` is that bandwidth over the device-to-device copy
bandwidth measured in the same run (a large ``copy_``, read + write counted); the target for
the fused kernels is >= 70%. One failing kernel or implementation is reported in its row and
the others go on. Conventions: bench/README.md (warm-up, median, random data).

Measured 2026-11-22 on one H200 (copy 4241 GB/s), bf16, %copy fwd / fwd+bwd, best fused impl:
softmax causal 75 / 85, +ALiBi 67 / 84; layer_norm 92 / 69; rms_norm 90 / 68; bias_gelu
tanh 82 / 71 (cuda 79 / 71), erf 66 / 59 (cuda; triton 57 / 56); rope 82 / 49. 75 s in all
with the CUDA extension already compiled (about 50 s more on a fresh machine).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import print_table, time_cuda, write_json
from bench.experimental import kernels as X
from megazoo import kernels as K
from megazoo.kernels import _dispatch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    """One kernel: inputs (the differentiable ones first), implementations, bytes moved."""

    name: str
    inputs: list[torch.Tensor]
    n_grad: int  # how many leading inputs get gradients
    impls: dict[str, Callable]
    bytes_fwd: int
    bytes_fwd_bwd: int


def _fused(fn, impl):
    return lambda *a: fn(*a, impl=impl)


def _cases(device, dtype, small: bool) -> list[Case]:
    """The benchmarked shapes: GPT-3 XL / LLaMA-7B-like activations (tiny with --small)."""
    r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    e = torch.tensor([], dtype=dtype).element_size()
    b, h, s = (1, 2, 128) if small else (4, 16, 2048)
    s_rope = 128 if small else 8192
    # every GPU tensor ~0.5 GB so that GPU time, not autograd's CPU time, is measured
    tokens, hidden, ffn = (256, 1000, 2048) if small else (65536, 4096, 16384)
    heads, d = (4, 64) if small else (32, 128)  # q [8192, 4, 32, 128]
    slopes = torch.rand(h, device=device)
    scores = r(b, h, s, s)
    n_sc = scores.numel() * e
    cos, sin = X.rope_cos_sin(torch.arange(s_rope, device=device), d)
    rows, cols = (tokens, hidden)
    gx = r(tokens // 4, ffn)
    n_x, n_g, q = rows * cols * e, gx.numel() * e, r(s_rope, b, heads, d)

    def softmax_case(name, alibi):
        sl = slopes if alibi else None
        ref = lambda x: X.softmax_reference(x, 0.125, sl, True)  # noqa: E731
        impls = {"triton": lambda x: X.scaled_masked_softmax(x, 0.125, sl, True, impl="triton"),
                 "eager": ref}
        # fwd: read scores, write probs; bwd: read probs and dprobs, write dscores
        return Case(name, [scores], 1, impls, 2 * n_sc, 5 * n_sc)

    ln_w, ln_b, x = r(cols), r(cols), r(rows, cols)
    gb = r(ffn)
    ln_impls = {"triton": _fused(K.layer_norm, "triton"), "eager": K.layer_norm_reference,
                "native": lambda x_, w, b_: F.layer_norm(x_, (cols,), w, b_, 1e-5)}
    rms_impls = {"triton": _fused(K.rms_norm, "triton"), "eager": K.rms_norm_reference,
                 "native": lambda x_, w: F.rms_norm(x_, (cols,), w, 1e-6)}
    gelu_impls = {i: (lambda impl: lambda x_, b_: X.bias_gelu(x_, b_, "tanh", impl=impl))(i)
                  for i in ("triton", "cuda")}
    gelu_impls["eager"] = lambda x_, b_: X.bias_gelu_reference(x_, b_, "tanh")
    erf_impls = {i: (lambda impl: lambda x_, b_: X.bias_gelu(x_, b_, "none", impl=impl))(i)
                 for i in ("triton", "cuda")}
    erf_impls["eager"] = lambda x_, b_: X.bias_gelu_reference(x_, b_, "none")
    rope_impls = {"triton": lambda x_: X.apply_rope(x_, cos, sin, impl="triton"),
                  "eager": lambda x_: X.rope_reference(x_, cos, sin)}
    n_q = q.numel() * e
    return [
        softmax_case(f"softmax causal [{b},{h},{s},{s}]", False),
        softmax_case(f"softmax alibi+causal [{b},{h},{s},{s}]", True),
        # fwd: read x, write y; bwd: read x, dy, write dx
        Case(f"layer_norm [{rows},{cols}]", [x, ln_w, ln_b], 3, ln_impls, 2 * n_x, 5 * n_x),
        Case(f"rms_norm [{rows},{cols}]", [x, ln_w], 2, rms_impls, 2 * n_x, 5 * n_x),
        Case(f"bias_gelu tanh [{tokens // 4},{ffn}]", [gx, gb], 2, gelu_impls, 2 * n_g, 5 * n_g),
        Case(f"bias_gelu erf [{tokens // 4},{ffn}]", [gx, gb], 2, erf_impls, 2 * n_g, 5 * n_g),
        # fwd: read q, write y; bwd: read dy, write dx
        Case(f"rope [{s_rope},{b},{heads},{d}]", [q], 1, rope_impls, 2 * n_q, 4 * n_q),
    ]


def _timer(device) -> Callable:
    """Median seconds per call. GPU: calls issued back to back between CUDA events, so the
    queue stays full and launch latency overlaps, as in training where the CPU runs ahead
    (one call per event pair would add the Python launch time of short kernels). CPU: a
    wall-clock median (dry runs only)."""
    if device.type == "cuda":
        def gpu_time(fn):
            once = time_cuda(fn, warmup=3, iters=3)
            reps = max(1, min(50, int(2e-3 / once) + 1))  # >= ~2 ms of work per timed sample

            def many():
                for _ in range(reps):
                    fn()
            return time_cuda(many, warmup=1, iters=10) / reps
        return gpu_time

    def cpu_time(fn):
        fn()
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return cpu_time


def copy_bandwidth(device, small: bool, timer) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + written (1 GiB tensor)."""
    n = (16 << 20) if small else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * n / seconds / 1e9


def _measure(case: Case, impl: str, fn, timer) -> dict:
    """Forward and forward+backward seconds of one implementation."""
    leaves = [t.detach().requires_grad_(k < case.n_grad) for k, t in enumerate(case.inputs)]
    grads = leaves[:case.n_grad]
    dy = torch.randn_like(fn(*leaves))

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves), grads, dy)

    return {"fwd": timer(lambda: fn(*leaves)), "fwd+bwd": timer(fwd_bwd)}


def run_case(case: Case, timer, copy_gbs: float, compile_: bool) -> list[dict]:
    """Rows for every implementation of one kernel; errors are recorded, never raised."""
    impls = dict(case.impls)
    if compile_:
        impls["compile"] = torch.compile(impls["eager"], dynamic=False)
    rows, eager = [], {}
    for impl, fn in impls.items():
        try:
            times = _measure(case, impl, fn, timer)
        except Exception as exc:  # report and go on with the other implementations
            rows.append({"kernel": case.name, "impl": impl, "error": _dispatch.first_line(exc)})
            continue
        if impl == "eager":
            eager = times
        for pass_, nbytes in (("fwd", case.bytes_fwd), ("fwd+bwd", case.bytes_fwd_bwd)):
            gbs = nbytes / times[pass_] / 1e9
            rows.append({"kernel": case.name, "impl": impl, "pass": pass_,
                         "ms": times[pass_] * 1e3, "GB/s": gbs, "%copy": 100 * gbs / copy_gbs})
    for row in rows:
        if "ms" in row and row["pass"] in eager:
            row["x eager"] = eager[row["pass"]] * 1e3 / row["ms"]
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU dry run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    parser.add_argument("--out", default=None, help="write the rows and run info as JSON")
    args = parser.parse_args(argv)
    device, t_start = torch.device(args.device), time.time()
    timer = _timer(device)
    copy_gbs = copy_bandwidth(device, args.small, timer)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows = []
    for case in _cases(device, DTYPES[args.dtype], args.small):
        if args.only and not any(k in case.name for k in args.only.split(",")):
            continue
        t0 = time.time()
        impls = {i: f for i, f in case.impls.items() if device.type == "cuda" or i not in ("triton", "cuda")}
        case.impls = impls
        rows += run_case(case, timer, copy_gbs, compile_=not args.no_compile)
        print(f"  {case.name}: {time.time() - t0:.1f}s", flush=True)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": _dispatch.triton_status()[1],
            "dtype": args.dtype, "copy_GB/s": copy_gbs, "seconds": time.time() - t_start}
    print_table(rows, ["kernel", "impl", "pass", "ms", "GB/s", "%copy", "x eager", "error"])
    print(f"{info['device']}, {info['dtype']}, copy {copy_gbs:.0f} GB/s, {info['seconds']:.0f}s total")
    write_json(args.out, {"info": info, "rows": rows})


if __name__ == "__main__":
    main()
