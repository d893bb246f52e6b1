"""One cuBLASLt call torch does not expose: an FP8 GEMM that accumulates into fp32.

    done = fp8_gemm_accumulate(a, b, scale_a, scale_b, out, accumulate=True)
    # out [N, K] fp32 (+)= (a [N, M] @ b [K, M]^T) * scale_a * scale_b; False: not run

The weight gradient of an FP8 linear, dW = dy^T x, is summed over micro-batches into an fp32
main gradient. `torch._scaled_mm` has no form that adds into its output (no beta), so
without this the GEMM writes a bf16 gradient that a second kernel adds into the fp32 buffer:
one more pass over 12 bytes per weight element per micro-batch. cuBLASLt itself takes
C = D = the fp32 buffer with beta = 1 (Transformer Engine's fused wgrad accumulation does
the same), so this module calls it through ctypes on the library torch already loaded.

It is an optional accelerator: `fp8_gemm_accumulate` returns False, and the caller takes the
unfused path, when the library or the call is not available (not Linux, no CUDA, an
operand not 16-byte aligned, cuBLASLt finding no algorithm). Enum values are cuBLASLt's
(the same in CUDA 12 and 13). Descriptors and the chosen algorithm are cached per shape and
dtype; the scale pointers are set on the cached descriptor before each launch, which reads
them on the host.
"""
from __future__ import annotations

import ctypes
import functools
import re

import torch

_DESC_TRANSA, _DESC_TRANSB, _DESC_A_SCALE, _DESC_B_SCALE = 3, 4, 17, 18
_PREF_MAX_WORKSPACE = 1
_COMPUTE_32F, _R_32F = 68, 0
_DTYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
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
        return ctypes.CDLL(paths[0]) if paths else None
    except (OSError, RuntimeError, IndexError):
        return None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


class _Plan:
    """Descriptors and algorithm for one (M, K, N, dtypes) on one device."""

    def __init__(self, lib, handle, m: int, k: int, n: int, a_dtype, b_dtype):
        self.lib, self.handle = lib, handle
        vp = ctypes.c_void_p
        self.desc, self.pref = vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        # column-major view: out^T [K, N] = op(A) [K, M] @ B [M, N]; A is b, B is a
        self.layouts = [self._layout(_DTYPES[b_dtype], m, k, m),
                        self._layout(_DTYPES[a_dtype], m, n, m),
                        self._layout(_R_32F, k, n, k)]
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

    def _set(self, attr: int, value) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                       ctypes.sizeof(value)), "attribute")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype,
                                                   ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                                   ctypes.c_int64(ld)), "layout")
        return layout

    def run(self, a, b, scale_a, scale_b, out, beta: float, workspace) -> None:
        vp = ctypes.c_void_p
        self._set(_DESC_A_SCALE, vp(scale_b.data_ptr()))
        self._set(_DESC_B_SCALE, vp(scale_a.data_ptr()))
        alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
        a_lay, b_lay, c_lay = self.layouts
        stream = vp(torch.cuda.current_stream(out.device).cuda_stream)
        _check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(alpha), vp(b.data_ptr()), a_lay,
            vp(a.data_ptr()), b_lay, ctypes.byref(beta_), vp(out.data_ptr()), c_lay,
            vp(out.data_ptr()), c_lay, ctypes.byref(self.heuristic.algo),
            vp(workspace.data_ptr()), ctypes.c_size_t(_WORKSPACE), stream), "matmul")


@functools.lru_cache(maxsize=None)
def _handle(device: int):
    with torch.cuda.device(device):
        handle = ctypes.c_void_p()
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "create")
        return handle


@functools.lru_cache(maxsize=None)
def _plan(device: int, m: int, k: int, n: int, a_dtype, b_dtype) -> _Plan | None:
    lib = _library()
    if lib is None:
        return None
    with torch.cuda.device(device):
        try:
            return _Plan(lib, _handle(device), m, k, n, a_dtype, b_dtype)
        except RuntimeError:
            return None


@functools.lru_cache(maxsize=None)
def _workspace(device: int) -> torch.Tensor:
    return torch.empty(_WORKSPACE, dtype=torch.uint8, device=f"cuda:{device}")


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def fp8_gemm_accumulate(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                        scale_b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> bool:
    """out (+)= (a @ b^T) * scale_a * scale_b in fp32, in one cuBLASLt GEMM.

    a [N, M] and b [K, M]: row-major FP8 (e4m3 / e5m2; not both e5m2); scale_a, scale_b:
    float32 scalars on the device; out [N, K] contiguous float32, overwritten when
    `accumulate` is False. Returns False without touching `out` where this path cannot run.
    """
    if (out.device.type != "cuda" or out.dtype != torch.float32 or not out.is_contiguous()
            or not a.is_contiguous() or not b.is_contiguous() or a.shape[1] != b.shape[1]
            or out.shape != (a.shape[0], b.shape[0]) or a.dtype not in _DTYPES
            or b.dtype not in _DTYPES or a.dtype == b.dtype == torch.float8_e5m2
            or scale_a.numel() != 1 or scale_b.numel() != 1 or a.shape[1] % 16
            or out.shape[1] % 4 or not _aligned(a, b, out)):
        return False
    device = out.get_device()  # the index, also for a tensor on plain "cuda"
    plan = _plan(device, a.shape[1], b.shape[0], a.shape[0], a.dtype, b.dtype)
    if plan is None:
        return False
    plan.run(a, b, scale_a.float(), scale_b.float(), out, 1.0 if accumulate else 0.0,
             _workspace(device))
    return True
