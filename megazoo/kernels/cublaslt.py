"""cuBLASLt GEMMs torch does not expose: accumulation into fp32 for FP8, and fused epilogues.

    ok = gemm(a, b, out, trans_b=True, beta=1.0, scale_a=sa, scale_b=sb)   # FP8, out fp32 +=
    ok = gemm(x, w, y, trans_b=True, epilogue="gelu_aux_bias", bias=b, aux=pre)
    ok = gemm(dy, w, dpre, epilogue="dgelu", aux=pre)

Row-major, as torch: out [m, n] = op(a) @ op(b) (+ beta * out), op(t) = t^T where asked,
a and b scaled by `scale_a` / `scale_b` (FP8). Epilogues, all in the GEMM's own kernel:
- "gelu_aux_bias" / "gelu_aux": aux = op(a) @ op(b) (+ bias [n]); out = gelu(aux) (tanh form);
- "dgelu": out = (op(a) @ op(b)) * gelu'(aux), aux [m, n] the forward's pre-activation.

Why: the weight gradient of an FP8 linear is summed over micro-batches into fp32, and
`torch._scaled_mm` has no form that adds into its output; a GELU MLP's activation and its
derivative are each a pass over an [tokens, ffn] activation that the neighbouring GEMM can
do while its tile is in registers (Transformer Engine uses the same epilogues). torch's own
matmuls offer neither, so this module calls cuBLASLt through ctypes on the library torch
already loaded.

It is an optional accelerator: `gemm` returns False, writing nothing, where it cannot run
(not Linux, no CUDA, a layout or alignment it does not take, cuBLASLt finding no algorithm),
and the caller computes the same thing with torch ops. Enum values are cuBLASLt's (the
same in CUDA 12 and 13). Descriptors and algorithm are validated and cached once per problem
(dtypes, shapes, strides, epilogue); a launch sets the pointers and checks their alignment.
"""
from __future__ import annotations

import ctypes
import functools
import re

import torch

_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS = 3, 4, 7, 8
_DESC_AUX, _DESC_AUX_LD, _DESC_A_SCALE, _DESC_B_SCALE, _DESC_BIAS_TYPE = 11, 12, 17, 18, 26
_PREF_MAX_WORKSPACE = 1
_COMPUTE_32F = 68
_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14,
           torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
EPILOGUES = {"default": 1, "gelu_aux": 160, "gelu_aux_bias": 164, "dgelu": 192}
_NEEDS_AUX = ("gelu_aux", "gelu_aux_bias", "dgelu")
_OP_N, _OP_T = 0, 1
_WORKSPACE = 32 << 20


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def _library():
    """The cuBLASLt torch loaded (found in /proc/self/maps), or None."""
    try:
        torch.ones(16, 16, device="cuda") @ torch.ones(16, 16, device="cuda")  # loads cuBLAS
        with open("/proc/self/maps") as f:
            paths = re.findall(r"(/\S*libcublasLt\.so[.\d]*)", f.read())
        lib = ctypes.CDLL(paths[0])
    except (OSError, RuntimeError, IndexError):
        return None
    vp, size = ctypes.c_void_p, ctypes.c_size_t  # pointers pass as plain ints
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, size]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   size, vp]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


class _Plan:
    """Descriptors and algorithm for one problem on one device.

    Column-major view of the row-major problem: out^T [n, m] = op(b)^T @ op(a)^T, so
    cuBLASLt's A is `b` (transposed iff trans_b) and its B is `a` (iff trans_a)."""

    def __init__(self, lib, handle, a, b, out, trans_a, trans_b, epilogue, bias, aux):
        self.lib, self.handle = lib, handle
        self.desc, self.pref = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F,
                                            _DTYPES[torch.float32]), "desc")
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T if trans_b else _OP_N))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_T if trans_a else _OP_N))
        self._set(_DESC_EPILOGUE, ctypes.c_int32(EPILOGUES[epilogue]))
        if bias is not None:
            self._set(_DESC_BIAS_TYPE, ctypes.c_int32(_DTYPES[bias.dtype]))
        if aux is not None:
            self._set(_DESC_AUX_LD, ctypes.c_int64(aux.stride(0)))
        self.layouts = [self._layout(t) for t in (b, a, out)]
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        size = ctypes.c_uint64(_WORKSPACE)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE,
                                                        ctypes.byref(size), 8), "preference")
        self.heuristic, count = _Heuristic(), ctypes.c_int(0)
        a_lay, b_lay, c_lay = self.layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a_lay, b_lay, c_lay,
                                                  c_lay, self.pref, 1,
                                                  ctypes.byref(self.heuristic),
                                                  ctypes.byref(count)), "heuristic")
        if count.value < 1:
            raise RuntimeError("cuBLASLt found no algorithm")
        # What each launch passes, as plain ints: the holder of each pointer attribute,
        # alpha / beta, the algorithm.
        self._pointer = ctypes.c_void_p()
        self._pointer_at = ctypes.addressof(self._pointer)
        self._scalars = [ctypes.c_float(v) for v in (1.0, 0.0, 1.0)]  # alpha, beta 0, beta 1
        self._alpha, self._beta0, self._beta1 = map(ctypes.addressof, self._scalars)
        self._args = [self.handle.value, self.desc.value, *(x.value for x in self.layouts),
                      ctypes.addressof(self.heuristic.algo)]

    def _set(self, attr: int, value) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                       ctypes.sizeof(value)), "attribute")

    def _layout(self, t: torch.Tensor):
        """Row-major t [rows, cols] (row stride ld) is column-major [cols, rows], ld."""
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _DTYPES[t.dtype], ctypes.c_uint64(t.shape[1]),
            ctypes.c_uint64(t.shape[0]), ctypes.c_int64(t.stride(0))), "layout")
        return layout

    def run(self, a_ptr: int, b_ptr: int, out_ptr: int, beta: float, pointers, stream: int,
            workspace: int) -> None:
        lib = self.lib
        for attr, ptr in pointers:
            self._pointer.value = ptr
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, self._pointer_at, 8),
                   "attribute")
        handle, desc, a_lay, b_lay, c_lay, algo = self._args
        _check(lib.cublasLtMatmul(handle, desc, self._alpha, b_ptr, a_lay, a_ptr, b_lay,
                                  self._beta1 if beta else self._beta0, out_ptr, c_lay,
                                  out_ptr, c_lay, algo, workspace, _WORKSPACE, stream), "matmul")


@functools.lru_cache(maxsize=None)
def _handle(device: int):
    with torch.cuda.device(device):
        handle = ctypes.c_void_p()
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "create")
        return handle


@functools.lru_cache(maxsize=None)
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(_WORKSPACE, dtype=torch.uint8, device=f"cuda:{device}")


_PLANS: dict[tuple, _Plan | None] = {}


def _matrix_ok(t: torch.Tensor) -> bool:
    """2-D, rows contiguous, 16-byte aligned row stride (cuBLASLt's vector loads)."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.stride(0) >= t.shape[1])


def _operands_ok(a, b, out, trans_a, trans_b, epilogue, bias, aux, scaled: bool) -> bool:
    """What the problem must satisfy, given its shapes, strides and dtypes (checked once)."""
    if epilogue not in EPILOGUES or (epilogue in _NEEDS_AUX) != (aux is not None):
        return False
    if (epilogue == "gelu_aux_bias") != (bias is not None):
        return False
    if not all(_matrix_ok(t) for t in (a, b, out, *([aux] if aux is not None else []))):
        return False
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k_b != k or tuple(out.shape) != (m, n):
        return False
    if scaled:  # Hopper FP8: a not transposed, b transposed, not both e5m2
        return (a.dtype in _FP8 and b.dtype in _FP8 and not a.dtype == b.dtype == torch.float8_e5m2
                and not trans_a and trans_b and k % 16 == 0 and epilogue == "default"
                and out.dtype == torch.float32)
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    if out.dtype not in (a.dtype, torch.float32):
        return False
    if aux is not None and (aux.dtype != out.dtype or aux.shape != out.shape):
        return False
    return bias is None or (bias.shape == (out.shape[1],) and bias.dtype == out.dtype)


def _plan(a, b, out, trans_a, trans_b, epilogue, bias, aux, scaled) -> _Plan | None:
    """The cached plan of this problem, or None where this path cannot take it."""
    key = (out.get_device(), a.dtype, a.shape, a.stride(), trans_a, b.dtype, b.shape, b.stride(),
           trans_b, out.dtype, out.shape, out.stride(), epilogue, scaled,
           None if bias is None else (bias.dtype, bias.shape, bias.stride()),
           None if aux is None else (aux.dtype, aux.shape, aux.stride()))
    if key not in _PLANS:
        plan, lib = None, _library()
        if lib is not None and _operands_ok(a, b, out, trans_a, trans_b, epilogue, bias, aux,
                                            scaled):
            with torch.cuda.device(key[0]):
                try:
                    plan = _Plan(lib, _handle(key[0]), a, b, out, trans_a, trans_b, epilogue,
                                 bias, aux)
                except RuntimeError:
                    plan = None
        _PLANS[key] = plan
    return _PLANS[key]


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, trans_a: bool = False,
         trans_b: bool = False, beta: float = 0.0, epilogue: str = "default",
         bias: torch.Tensor | None = None, aux: torch.Tensor | None = None,
         scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None) -> bool:
    """out [m, n] (+)= op(a) @ op(b) in one cuBLASLt call, with `epilogue` (module docstring).

    a, b: bf16 / fp16 (the same), or FP8 with float32 scalar scales (trans_a False, trans_b
    True, out float32); out: their dtype or float32, rows contiguous. beta: 0 or 1. bias:
    [n] in out's dtype for "gelu_aux_bias". aux: [m, n] like out.
    Returns False without writing anything where this path cannot run.
    """
    scaled = scale_a is not None or scale_b is not None
    if out.device.type != "cuda" or beta not in (0.0, 1.0) or (
            scaled and (scale_a is None or scale_b is None or scale_a.numel() != 1
                        or scale_b.numel() != 1 or scale_a.dtype != torch.float32
                        or scale_b.dtype != torch.float32)):
        return False
    plan = _plan(a, b, out, trans_a, trans_b, epilogue, bias, aux, scaled)
    if plan is None:
        return False
    pointers = [(attr, t.data_ptr()) for attr, t in ((_DESC_BIAS, bias), (_DESC_AUX, aux),
                                                     (_DESC_A_SCALE, scale_b),
                                                     (_DESC_B_SCALE, scale_a)) if t is not None]
    a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if (a_ptr | b_ptr | out_ptr | (aux.data_ptr() if aux is not None else 0)) % 16 or (
            bias is not None and bias.data_ptr() % 16):
        return False
    plan.run(a_ptr, b_ptr, out_ptr, beta, pointers,
             torch.cuda.current_stream(out.device).cuda_stream,
             _workspace(out.get_device()).data_ptr())
    return True


def fp8_gemm_accumulate(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> bool:
    """out (+)= (a @ b^T) * scale_a * scale_b in fp32: a [N, M], b [K, M] row-major FP8,
    out [N, K] float32 (overwritten when `accumulate` is False). False: not run."""
    if not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        return False
    return gemm(a, b, out, trans_b=True, beta=1.0 if accumulate else 0.0,
                scale_a=scale_a.float(), scale_b=scale_b.float())
