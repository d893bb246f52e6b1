"""Test-session setup: GPU markers, and Triton's CPU interpreter where no GPU is present.

Markers:

* ``@pytest.mark.gpu(count=N)``: needs N CUDA GPUs; skipped where fewer are visible.
* ``@pytest.mark.triton``: runs Triton kernels. On a GPU they run compiled; without one they
  run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set below before
  anything imports triton, which reads it at import and when a kernel is defined: tests must
  not unset it). Skipped where triton does not import, or on CPU when the interpreter was
  switched off (``TRITON_INTERPRET=0`` in the environment). The ``triton_device`` fixture is
  the device such a test puts its tensors on.

The interpreter only changes where explicitly requested Triton kernels can run: megazoo's
automatic dispatch still uses the PyTorch fallback for every CPU tensor.
"""
import sys
from pathlib import Path

# Tests sit in one folder per package (tests/layers, tests/training, ...); the code they share
# is the package tests/helpers, imported as `helpers.<module>`. Put tests/ on the path before
# any test module is imported (spawned ranks inherit it). Test modules never import each other.
_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(1, str(_HERE))

import importlib.util
import os

import pytest
import torch

# DeepSpeed builds its CPU ops (cpu_adam, ...) with torch's extension loader. The tests get a
# folder of their own under the checkout, so a build killed by some other program in the shared
# ~/.cache/torch_extensions cannot fail them (an explicit TORCH_EXTENSIONS_DIR still wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_HERE.parent / "build" / "test_torch_extensions"))

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _triton_skip_reason() -> str | None:
    """Why @pytest.mark.triton tests cannot run here, or None."""
    if not HAS_TRITON:
        return "triton is not installed (pip install -e '.[test]' installs it)"
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU and TRITON_INTERPRET is not 1 (Triton's CPU interpreter is off)"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "triton: runs Triton kernels (on CPU: the interpreter)")
    config.addinivalue_line("markers", "slow: spawns training processes (runs in CI too; "
                                       "-m 'not slow' leaves them out locally)")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if HAS_CUDA else 0
    triton_skip = _triton_skip_reason()
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = marker.kwargs.get("count", 1) if marker else 0
        if needed > gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPU(s), found {gpus}"))
        if triton_skip and item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.skip(reason=triton_skip))


@pytest.fixture
def triton_device() -> torch.device:
    """Where @pytest.mark.triton tests run their kernels: the GPU, else the CPU interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
