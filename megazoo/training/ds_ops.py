"""DeepSpeed's C++ ops, built by torch's JIT on first use: say so, and never wait silently.

    prepare_ops(ds_config, announce=rank0)   # before deepspeed.initialize, on every rank

A first build takes minutes and prints nothing, so each op this run will build gets one line
first ("building DeepSpeed's cpu_adam op, about 2 minutes the first time"). torch serialises
builds with a `lock` file in the op's build folder (`~/.cache/torch_extensions/py311_cpu/
<op>/lock`, or under $TORCH_EXTENSIONS_DIR) and waits for it to vanish even when the op is
built; a build killed midway leaves it there and every later run waits forever. A lock that
no process on this host holds open (the builder keeps its descriptor until it removes the
file) and that is older than `HOLDER_GRACE_S`, or that is older than any build could take
(`STALE_AFTER_S`), is reported as an error naming the file to remove.

Ops this run does not need are not built: `shm_comm` serves only DeepSpeed's inference
all-reduce (training reduces through torch.distributed), so it is marked unavailable in
`deepspeed.ops.__compatible_ops__` (which DeepSpeed reads before building it); `cpu_adam` is
built only with an offloaded optimizer and `async_io` only with NVMe offload.
"""
from __future__ import annotations

import os
import sys
import time

import torch

# op name -> (name in messages, minutes a first build takes on a 2-core host, rounded up)
OPS = {"cpu_adam": ("cpu_adam", 2), "async_io": ("async_io", 1)}
STALE_AFTER_S = 2 * 3600
HOLDER_GRACE_S = 30


def extensions_root() -> str:
    """Where torch's JIT puts extension builds (mirrors torch.utils.cpp_extension)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    if torch.version.hip:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{accel}")


def lock_holders(lock: str) -> list[int] | None:
    """Pids on this host with `lock` open (None when /proc cannot tell)."""
    if not os.path.isdir("/proc"):
        return None
    target, holders = os.path.realpath(lock), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return holders


def check_lock(name: str, log) -> None:
    """ValueError naming the file if `name`'s build lock is stale; a line if it is live."""
    label = OPS.get(name, (name, 0))[0]
    lock = os.path.join(extensions_root(), name, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    holders = lock_holders(lock)
    if age > STALE_AFTER_S or (holders == [] and age > HOLDER_GRACE_S):
        why = (f"{age / 60:.0f} minutes old, longer than any build takes" if age > STALE_AFTER_S
               else "no process holds it")
        raise ValueError(f"{lock} is left by a killed build of DeepSpeed's {label} op ({why}); "
                         f"every run would wait on it: remove it (rm {lock}) and run again")
    who = f"process {holders[0]}" if holders else "another process"
    log(f"waiting for {who} building DeepSpeed's {label} op (lock {lock})")


def is_built(name: str) -> bool:
    """Whether loading `name` needs no compiler: installed with DeepSpeed, or JIT-built."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    return bool(installed_ops.get(name)) or \
        os.path.isfile(os.path.join(extensions_root(), name, f"{name}.so"))


def before_build(name: str, log) -> None:
    """Check `name`'s lock, and say that a build is coming when it is not built yet."""
    check_lock(name, log)
    if not is_built(name):
        label, minutes = OPS.get(name, (name, 1))
        log(f"building DeepSpeed's {label} op, about {minutes} minute{'s' if minutes > 1 else ''}"
            f" the first time (cached in {os.path.join(extensions_root(), name)})")


def needed_ops(ds: dict) -> list[str]:
    """The JIT-built ops a training run with DeepSpeed config `ds` loads."""
    zero = ds.get("zero_optimization", {})
    devices = {(zero.get(k) or {}).get("device") for k in ("offload_optimizer", "offload_param")}
    return ["async_io"] if "nvme" in devices else []


def prepare_ops(ds: dict, announce: bool = True) -> None:
    """Before deepspeed.initialize: skip what training does not use, and check / announce
    the builds it does (`cpu_adam` is handled where it is loaded). Lines go to stderr."""
    import deepspeed.ops

    log = (lambda text: print(text, file=sys.stderr, flush=True)) if announce else (lambda _: None)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # its inference all-reduce
    for name in needed_ops(ds):
        before_build(name, log)
