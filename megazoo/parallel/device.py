"""The device a rank computes on."""
from __future__ import annotations

import os

import torch


def local_device() -> torch.device:
    """This rank's accelerator (LOCAL_RANK, made current) when there is one, else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)
