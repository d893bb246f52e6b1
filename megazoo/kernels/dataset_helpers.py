"""The C++ dataset index helpers' extension (`csrc/data_helpers.cpp`): found prebuilt, or
compiled on first use into torch's extension cache, and which implementation a request
gets (`choose`), as the kernels' `Choice`. `megazoo.data.helpers` runs them (with its NumPy
fallback); `python -m megazoo.kernels` reports `backend()`.
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType

from ._dispatch import Choice, first_line

#: Compiler flags for ``csrc/data_helpers.cpp``, setup.py's too (``-ffp-contract=off`` keeps
#: blending free of fused multiply-adds, see the .cpp).
CXX_FLAGS: tuple[str, ...] = ("-O3", "-ffp-contract=off")
CPP_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "data_helpers.cpp"


@functools.lru_cache(maxsize=1)
def load_compiled() -> tuple[ModuleType | None, str]:
    """Import or build the C++ module once per process; never raises."""
    try:
        return importlib.import_module("megazoo._data_helpers"), "prebuilt megazoo._data_helpers"
    except ImportError:
        pass
    if not CPP_SOURCE.is_file():
        return None, f"no prebuilt megazoo._data_helpers and no source at {CPP_SOURCE}"
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(name="megazoo_data_helpers", sources=[str(CPP_SOURCE)],
                                    extra_cflags=list(CXX_FLAGS), verbose=False)
    except Exception as exc:  # any toolchain failure means: use NumPy
        return None, f"compiling {CPP_SOURCE.name} failed: {first_line(exc, 200)}"
    return module, f"compiled {CPP_SOURCE.name} with torch.utils.cpp_extension"


def choose(use_cpp: bool | None, load=load_compiled) -> tuple[ModuleType | None, Choice]:
    """(module or None, why) for a ``use_cpp`` request (``megazoo.data.helpers``'s rule);
    `load` is called only when the compiled module may be used."""
    if use_cpp is False:
        return None, Choice("numpy", "requested with use_cpp=False")
    if use_cpp is None and os.environ.get("MEGAZOO_NO_CPP") == "1":
        return None, Choice("numpy", "MEGAZOO_NO_CPP=1 is set")
    module, reason = load()
    if module is None:
        if use_cpp:
            raise RuntimeError(f"C++ data helpers unavailable: {reason}; "
                               "pass use_cpp=None or False to use NumPy")
        return None, Choice("numpy", reason)
    return module, Choice("cpp", reason)


def backend(use_cpp: bool | None = None) -> Choice:
    """Say which implementation ``use_cpp`` selects (compiling the C++ if needed)."""
    return choose(use_cpp)[1]
