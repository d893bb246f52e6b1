"""The checks an offloading run makes before training, which the planner applies too: an
unwritable `--nvme-path`, a host or a disk too small for the plan (one line each, naming the
numbers in GB).
"""
from __future__ import annotations

import os
import shutil
import tempfile

from .bytes import GB


def check_nvme_path(path: str) -> float:
    """Create `path` if needed, check that a file can be written there, and return the free
    bytes of its file system; ValueError naming the path otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".megazoo-write-test"):
            pass
        return float(shutil.disk_usage(path).free)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--nvme-path {path} is not a writable folder ({reason}): pass a "
                         "folder on a local disk you can write to") from None


def host_memory_bytes() -> float | None:
    """Memory the host can give this process now (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_offload_plan(host_needed: float, disk_needed: float, *, host_memory: float | None,
                       disk_memory: float | None, nvme_path: str | None = None,
                       ranks_per_host: int = 1) -> None:
    """ValueError (one line, the numbers in GB) when the host or the disk cannot hold what the
    plan puts there; `host_memory` / `disk_memory` None: not checked. `host_needed` and
    `disk_needed` are one rank's; `ranks_per_host` ranks share the host and the disk."""
    host_all, disk_all = host_needed * ranks_per_host, disk_needed * ranks_per_host
    ranks = f" ({ranks_per_host} ranks x {gb_text(host_needed)} GB)" if ranks_per_host > 1 else ""
    if host_memory is not None and host_all > host_memory:
        advice = ("pass --nvme-path DIR to keep the optimizer state on disk" if not nvme_path
                  else "use a smaller model or more GPUs")
        raise ValueError(f"the plan needs {gb_text(host_all)} GB of host memory{ranks} but "
                         f"{gb_text(host_memory)} GB is available: lower "
                         f"--optimizer-offload-fraction (more state on the GPU) or {advice}")
    if disk_all > 0 and disk_memory is not None and disk_all > disk_memory:
        where = f"under --nvme-path {nvme_path}" if nvme_path else "on the disk"
        raise ValueError(f"the plan needs {gb_text(disk_all)} GB {where} but "
                         f"{gb_text(disk_memory)} GB is free: free space there, point "
                         "--nvme-path at a larger disk, or lower --optimizer-offload-fraction")


def gb_text(nbytes: float) -> str:
    """GB with one decimal, or three significant digits below 0.1 GB (no "0.0 GB")."""
    return f"{nbytes / GB:.1f}" if nbytes >= 0.1 * GB else f"{nbytes / GB:.3g}"
