"""The device a rank computes on, and what that device can do.

`local_device()` picks this rank's accelerator. `compute_capability(device)` asks the driver
once per device: the query costs more than a kernel launch, and the layers ask on every call
(which attention backend runs here, whether FP8 tensor cores exist), so the answer is cached.
"""
from __future__ import annotations

import functools
import os

import torch


def local_device() -> torch.device:
    """This rank's accelerator (LOCAL_RANK, made current) when there is one, else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, (0, 0) for any other device. A CUDA device without an
    index means the current one, asked each time (it can change)."""
    if device.type != "cuda":
        return (0, 0)
    if device.index is None:
        return torch.cuda.get_device_capability(device)
    return _cuda_capability(device.index)
