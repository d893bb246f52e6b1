"""Which implementation runs a fused kernel, and why: Triton or PyTorch.

``"torch"`` is the pure-PyTorch reference, always available; ``"triton"`` a kernel of
``megazoo.kernels.triton_*``, for CUDA tensors where triton imports (CPU tests run it under
``TRITON_INTERPRET=1`` by asking for it).

Everything loaded is cached with ``functools.lru_cache`` (the only module state): a
failure is remembered with its first line, so it is tried once per process.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

#: Implementation names.
IMPLS = ("triton", "torch")


@dataclass(frozen=True)
class Choice:
    """The implementation a call uses and one line saying why."""

    impl: str
    """``"triton"`` or ``"torch"`` (the data helpers': ``"cpp"`` or ``"numpy"``)."""
    reason: str


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first non-empty line of an exception message (its type name if it has none)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:limit]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The fallbacks' math dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (it must be set before kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def triton_status() -> tuple[bool, str]:
    """(usable, one line): whether ``import triton`` works here; never raises."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # a broken install must not break megazoo
        return False, f"import triton failed: {first_line(exc)}"
    return True, f"triton {triton.__version__}"


@functools.lru_cache(maxsize=None)
def triton_module(family: str) -> ModuleType:
    """Import ``megazoo.kernels.triton_<family>`` (defines its kernels) once; a dotted
    `family` names the module itself (kernels kept outside the library)."""
    ok, reason = triton_status()
    if not ok:
        raise RuntimeError(f"Triton kernels unavailable: {reason}")
    return importlib.import_module(family if "." in family else f"megazoo.kernels.triton_{family}")


def automatic(x: torch.Tensor, *, unsupported: str | None = None) -> list[Choice]:
    """Implementations usable for `x` when the caller names none, best first; torch last.

    `unsupported` is why the fused kernels cannot take these arguments (a shape limit, a
    dtype), or None.
    """
    if not x.is_cuda:
        return [Choice("torch", f"tensor on {x.device.type}: fused kernels need a CUDA GPU")]
    if unsupported:
        return [Choice("torch", unsupported)]
    ok, reason = triton_status()
    if not ok:
        return [Choice("torch", reason)]
    return [Choice("triton", reason), Choice("torch", "fallback")]


def pick(x: torch.Tensor, impl: str | None, *, unsupported: str | None = None) -> str:
    """The implementation to run: the caller's `impl` if it can run, else the first automatic.

    A requested impl that cannot run raises RuntimeError saying why (never silently slower).
    """
    if impl is None:
        return automatic(x, unsupported=unsupported)[0].impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton":
        ok, reason = triton_status()
        if not ok:
            raise RuntimeError(f"impl='triton' requested but {reason}")
        if not x.is_cuda and not interpreting():
            raise RuntimeError("impl='triton' on a CPU tensor needs TRITON_INTERPRET=1 "
                               "(set before megazoo.kernels' Triton kernels are imported)")
    if impl != "torch" and unsupported:
        raise RuntimeError(f"impl={impl!r} cannot take these arguments: {unsupported}")
    return impl
