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


def backend_devices(group=None) -> set[str]:
    """The device types the process group `group` (None: the default one) has a backend for:
    {"cuda"} for the NCCL-only group that `init_process_group()` makes on a GPU machine,
    {"cpu", "cuda"} for gloo or "cpu:gloo,cuda:nccl"."""
    import torch.distributed as dist

    return {pair.split(":")[0].strip() for pair in dist.get_backend_config(group).split(",")}


def comm_device(device: torch.device, group=None) -> torch.device:
    """Where a collective over `group` can take a tensor that lives on `device`: `device` when
    the group has a backend for its type, else this rank's accelerator (a host tensor under an
    NCCL-only group, such as an offloaded gradient: copied there and back by the caller).
    Host tensors are not given a gloo backend beside NCCL instead: every megazoo collective
    of a GPU run then stays on NVLink / the NIC, and a stray host tensor is one copy, not a
    second transport."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type in backend_devices(group):
        return device
    if not torch.accelerator.is_available():
        raise RuntimeError(f"the process group has no backend for {device.type} tensors "
                           f"({backend_devices(group)}) and this rank has no accelerator")
    return torch.device(torch.accelerator.current_accelerator().type,
                        torch.accelerator.current_device_index())
