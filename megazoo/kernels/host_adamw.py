"""The offloaded optimizer's host AdamW in one pass (csrc/host_adamw.c), or None.

    kernel = host_adamw()          # None where no C compiler works (torch's kernel then runs)
    kernel(state, grad, pieces, out=up, divisor=d, beta1=..., ...)  # state {master, exp_avg, exp_avg_sq}

torch's fused CPU AdamW needs an fp32 gradient and leaves the bf16 parameters to another
pass; the C kernel reads a bf16 (or fp32) gradient and writes the bf16 parameters for the
upload in the pass that steps, with torch's arithmetic (the .c file's header), so an
offloaded step keeps computing the numbers of the un-offloaded engine (tests compare both).

The source is compiled once per source version and CPU with the system C compiler (`cc -O3
-march=native -fopenmp`, a second or two) into MEGAZOO_CACHE (default ~/.cache/megazoo) and loaded with
ctypes, which releases the GIL during the call, so the optimizer's worker thread steps
while the main thread launches GPU work. `MEGAZOO_NO_HOST_KERNEL=1` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from ._dispatch import Choice, first_line

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "host_adamw.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC",
         "-shared")

_f32, _i64 = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGAZOO_CACHE", Path.home() / ".cache" / "megazoo"))


def _cpu() -> bytes:
    """This CPU's identity (-march=native builds for it): /proc/cpuinfo's first flags line."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((ln for ln in f if ln.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


def _compile() -> ctypes.CDLL:
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu()).hexdigest()[:16]
    lib = _cache_dir() / f"host_adamw_{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # rename: never half-written
            built = Path(tmp) / lib.name
            subprocess.run([os.environ.get("CC", "cc"), *FLAGS, str(SOURCE), "-o", str(built),
                            "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(built, lib)
    dll = ctypes.CDLL(str(lib))
    fn = dll.megazoo_adamw
    fn.restype = None
    fn.argtypes = [_f32, _f32, _f32, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int64, _i64, _i64, _f32, _f32, _f32, ctypes.c_float, ctypes.c_float,
                   ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return dll


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, Choice]:
    """The library and why (compiled once per process; a failure is remembered)."""
    if os.environ.get("MEGAZOO_NO_HOST_KERNEL") == "1":
        return None, Choice("torch", "MEGAZOO_NO_HOST_KERNEL=1 is set")
    try:
        return _compile(), Choice("c", f"compiled {SOURCE.name} with cc {' '.join(FLAGS[:3])}")
    except subprocess.CalledProcessError as exc:
        return None, Choice("torch", f"compiling {SOURCE.name} failed: "
                                     f"{first_line(RuntimeError(exc.stderr.decode()))}")
    except Exception as exc:  # no compiler, no source, a cache that cannot be written
        return None, Choice("torch", f"{SOURCE.name} unavailable: {first_line(exc)}")


def backend() -> Choice:
    """Which host AdamW the offload uses here, and why."""
    return _load()[1]


def _ptr(t: torch.Tensor, kind):
    return ctypes.cast(t.data_ptr(), kind)


def _check(state: dict, grad: torch.Tensor, out: torch.Tensor | None) -> None:
    n = state["master"].numel()
    for name, t in state.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"host AdamW: state {name} must be contiguous float32 on the CPU "
                             f"with {n} elements")
    if grad.dtype not in (torch.float32, torch.bfloat16) or grad.numel() != n or not grad.is_contiguous():
        raise ValueError(f"host AdamW: gradient must be contiguous float32 / bfloat16 with {n} elements")
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"host AdamW: out must be contiguous bfloat16 with {n} elements")


def host_adamw():
    """The fused kernel as a function, or None where it cannot be had (module docstring)."""
    dll = _load()[0]
    if dll is None:
        return None

    def step(state: dict, grad: torch.Tensor, pieces: list[tuple], *,
             out: torch.Tensor | None, divisor, beta1: float, beta2: float, eps: float) -> None:
        """AdamW over `pieces` (start, end, lr x weight decay, step size, sqrt of the second
        bias correction: `cpu_offload.adamw_piece`) of the flat state, the gradient divided by
        `divisor` (a float or a CPU scalar tensor); out, if given, gets the new parameters in
        bf16."""
        _check(state, grad, out)
        starts, ends, decay, size, bc2 = zip(*pieces)
        starts, ends = (torch.tensor(x, dtype=torch.int64) for x in (starts, ends))
        decay, size, bc2 = (torch.tensor(x, dtype=torch.float32) for x in (decay, size, bc2))
        dll.megazoo_adamw(*(_ptr(state[k], _f32) for k in ("master", "exp_avg", "exp_avg_sq")),
                          grad.data_ptr(), int(grad.dtype == torch.bfloat16),
                          None if out is None else out.data_ptr(), len(pieces),
                          _ptr(starts, _i64), _ptr(ends, _i64), _ptr(decay, _f32),
                          _ptr(size, _f32), _ptr(bc2, _f32), beta1, beta2, eps, float(divisor),
                          torch.get_num_threads())
    return step
