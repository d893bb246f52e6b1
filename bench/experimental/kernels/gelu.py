"""Fused bias + GeLU (the MLP's first activation), forward and backward, with a fallback.

Experimental, outside the library: no model selects it (bench/model_bench.py
`--impls megazoo-kernels` routes the MLP's GeLU through it to measure whether wiring it in
wins; bench/README.md). Its CUDA C++ variant, fused_bias_gelu.cu beside this file, is
compiled on first use on a GPU (`cuda_extension`).

Function computed by every implementation, for ``x [..., N]`` and ``bias [N]`` (cast to
x's dtype first), in float32, rounded once to ``x.dtype``:

    u = x + bias;  y = gelu(u)
    approximate="tanh": 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))   (GPT-2, Megatron)
    approximate="none": u * Phi(u) = 0.5 u (1 + erf(u / sqrt 2))          (exact)

Backward: ``dx = dy * gelu'(u)`` and ``dbias = dx`` summed over every dim but the last.

Two fused implementations exist: Triton (``triton_gelu``) and CUDA C++
(``csrc/fused_bias_gelu.cu``, 16-byte vector accesses). When both can run, the first CUDA
call for a (device, dtype, approximate) times forward + backward of each on a
``4096 x 4096`` tensor with CUDA events and keeps the faster one for the process
(``fastest_impl``, cached); ``bench/kernels_bench.py`` shows both side by side, and
``impl="triton"``/``"cuda"`` forces one. Why Triton at all: elementwise fusion is where
Triton equals hand CUDA with a fraction of the code and no build step; the CUDA version is
here as the compiled-extension path (built by setup.py or on first use).
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from bench.common import time_ms
from megazoo.kernels import _dispatch

TRITON_MODULE = "bench.experimental.kernels.triton_gelu"
CUDA_SOURCE = Path(__file__).resolve().parent / "fused_bias_gelu.cu"
JIT_MODULE_NAME = "megazoo_fused_bias_gelu"  # in torch's extension cache

_APPROXIMATE = ("tanh", "none")


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The PyTorch fallback: F.gelu(x + bias) in float32 (float64 for float64), result in x.dtype."""
    f = _dispatch.compute_dtype(x)
    u = x.to(f) + bias.to(x.dtype).to(f)
    return F.gelu(u, approximate=approximate).to(x.dtype)


def _jit_arch_flags(device: torch.device) -> list[str]:
    """nvcc flags for the compute capability of `device` only (a faster JIT build)."""
    major, minor = torch.cuda.get_device_capability(device)
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


@functools.lru_cache(maxsize=None)
def cuda_extension(device_index: int) -> tuple[ModuleType | None, str]:
    """fused_bias_gelu.cu compiled on first use for a GPU (torch caches it), else (None, why).

    Only called for tensors already on a CUDA device; never raises.
    """
    try:
        from torch.utils import cpp_extension

        flags = ["-O3", "-std=c++17"] + _jit_arch_flags(torch.device("cuda", device_index))
        module = cpp_extension.load(name=JIT_MODULE_NAME, sources=[str(CUDA_SOURCE)],
                                    extra_cflags=["-O3", "-std=c++17"],
                                    extra_cuda_cflags=flags, verbose=False)
    except Exception as exc:  # no nvcc, version mismatch, compile error: use the others
        return None, f"building {CUDA_SOURCE.name} failed: {_dispatch.first_line(exc)}"
    return module, f"compiled {CUDA_SOURCE.name} on first use"


def _fused_module(impl: str, device: torch.device):
    """The object with bias_gelu_forward / bias_gelu_backward for a fused impl."""
    if impl == "triton":
        return _dispatch.triton_module(TRITON_MODULE)
    return cuda_extension(device.index or 0)[0]


class _FusedBiasGelu(torch.autograd.Function):
    """forward: y = gelu(x + b) by a fused kernel; backward: dx by the kernel, db = sum(dx).

    x [..., N], bias [N] of x's dtype; saved: x, bias (u = x + b is recomputed, not stored).
    """

    @staticmethod
    def forward(ctx, x, bias, tanh, impl):
        module = _fused_module(impl, x.device)
        x = x.contiguous()
        bias = bias.contiguous()
        ctx.save_for_backward(x, bias)
        ctx.tanh, ctx.impl = tanh, impl
        return module.bias_gelu_forward(x, bias, tanh)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        module = _fused_module(ctx.impl, x.device)
        dx = module.bias_gelu_backward(dy.contiguous(), x, bias, ctx.tanh)
        dbias = dx.reshape(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None, None


def _time_impl(impl: str, x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> float:
    """Median milliseconds of forward + backward of one fused impl (bench.common.time_ms)."""
    module = _fused_module(impl, x.device)
    dy = torch.randn_like(x)

    def step():
        module.bias_gelu_backward(dy, x, bias, tanh)
        module.bias_gelu_forward(x, bias, tanh)

    return time_ms(step, x.device, warmup=3, iters=10)


@functools.lru_cache(maxsize=None)
def fastest_impl(device: torch.device, dtype: torch.dtype, tanh: bool, candidates: tuple[str, ...]) -> str:
    """The faster of `candidates` for bias+GeLU on `device`, measured once per process."""
    if len(candidates) == 1:
        return candidates[0]
    x = torch.randn(4096, 4096, device=device, dtype=dtype)
    bias = torch.randn(4096, device=device, dtype=dtype)
    times = {impl: _time_impl(impl, x, bias, tanh) for impl in candidates}
    return min(times, key=times.get)


def unsupported(x: torch.Tensor) -> str | None:
    """Why the fused kernels cannot take x, or None if they can."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} has no fused kernel"
    if x.numel() == 0:
        return "empty input"
    return None


def _check_cuda(x: torch.Tensor) -> None:
    """RuntimeError saying why impl="cuda" (the CUDA C++ kernel) cannot run on x."""
    if not x.is_cuda:
        raise RuntimeError("impl='cuda' needs a CUDA tensor")
    module, reason = cuda_extension(x.device.index or 0)
    if module is None:
        raise RuntimeError(f"impl='cuda' requested but {reason}")
    if unsupported(x):
        raise RuntimeError(f"impl='cuda' cannot take these arguments: {unsupported(x)}")


def _pick(x: torch.Tensor, impl: str | None, tanh: bool) -> str:
    """The caller's impl if it can run; else the measured-fastest fused one, else torch."""
    if impl == "cuda":
        _check_cuda(x)
        return impl
    if impl is not None:
        return _dispatch.pick(x, impl, unsupported=unsupported(x))
    choices = _dispatch.automatic(x, unsupported=unsupported(x))
    fused = tuple(c.impl for c in choices if c.impl != "torch")
    if x.is_cuda and not unsupported(x) and cuda_extension(x.device.index or 0)[0] is not None:
        fused += ("cuda",)
    if not fused:
        return "torch"
    if len(fused) > 1 and torch.cuda.is_current_stream_capturing():
        return fused[0]  # no timing inside CUDA-graph capture
    return fastest_impl(x.device, x.dtype, tanh, fused)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh", *,
              impl: str | None = None) -> torch.Tensor:
    """gelu(x + bias) for x [..., N], bias [N]; result in x.dtype (see module docstring).

    `impl`: None picks the best available (the measured-faster of "triton"/"cuda" on a GPU,
    else "torch"); "triton", "cuda" or "torch" forces one (RuntimeError if it cannot run).
    """
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [N={x.shape[-1]}], got {tuple(bias.shape)}")
    chosen = _pick(x, impl, approximate == "tanh")
    if chosen == "torch":
        return bias_gelu_reference(x, bias, approximate)
    return _FusedBiasGelu.apply(x, bias.to(x.dtype), approximate == "tanh", chosen)
