"""The largest model this machine trains, as `python -m megazoo.plan --largest` answers it,
trained for real: bench/offload_bench.py's `--largest` and `--peer-largest` rows, and the
fraction its `bf16grads` rows use.

    planned = plan_largest(budgets, flags)     # {"command": ..., "num_parameters": ...}
    rows = largest_rows(name, planned, gbs, iters, dry, left)

The budgets are this machine's: free GPU memory, MemAvailable of the host, free disk under
--nvme-path (GB, 1e9 bytes), the disk share capped (below). The
plain engine asks with --optimizer-cpu-offload --accumulate-grads-in-bf16 --nvme-path DIR
--save "" (the rows do not save): its host share stays in host memory where it fits and
the rest goes to disk, and the planner's command pins that split with
--optimizer-offload-host-memory. The peer (DeepSpeed ZeRO-3) asks with its CPU optimizer
and parameter offload (the planner models DeepSpeed's cpu offload, not its nvme).

Why a disk cap (`plan_target`). The state on disk is read and written once per step, so a
step takes at least 2 x disk share / disk rate. Uncapped, the search answers the largest
the whole disk holds (13.98B with 39 GB on disk on 80 GB / 125 GB / 40 GB; more with more
disk), which a 10-minute call may not train 10 steps of. So the row asks with the disk
share capped at 32 GB, then 36, 40, 48 GB, and trains the first answer of at least 13B
(TARGET): on 84 GB / 125 GB (the H100 machine's free GPU memory and a MemAvailable of 125
GB) that is a 13.55B LLaMA with 32 GB on disk, ~32 s per step at 2 GB/s each way; 10 steps
and the start (~1.5 min: the fp32 model to the host, ~100 GB of state filled, the disk
files written) ~6 minutes: one global batch per 10-minute call. `disk_rates` measures the
disk's rates first (O_DIRECT, as the store does); --largest-disk sets one cap instead.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from bench.common import REPO, child_env

PLAIN = ["--optimizer-cpu-offload", "--accumulate-grads-in-bf16"]
# DeepSpeed's largest: optimizer offload only. Its parameter offload adds pinned host copies
# on a host that is already the limit (the GPU is a third full): a 5.66B plan with it was
# killed at start-up on the lent machine, and the planner answers 6.66B without it.
PEER = ["--deepspeed", "--zero-stage", "3", "--offload-optimizer", "cpu"]
PEER_HOST_MARGIN = 6.0  # GB below MemAvailable for the peer: its plan is not measured there
DROP = {"--global-batch-size", "--micro-batch-size"}  # the rows set their own
TARGET = 13e9  # parameters the largest row aims at (the target)
DISK_CAPS = (32.0, 36.0, 40.0, 48.0)  # disk shares tried, smallest first (module docstring)
# the dry run's disk tier: small buckets and a host budget that sends the tiny model to disk
DRY_SPLIT = ["--ddp-bucket-size", "10000", "--optimizer-offload-host-memory", "0.01"]


def machine_budgets(nvme_path: str | None, dry: bool, host_margin: float = 0.0) -> list[str]:
    """--gpu-memory / --host-memory / --disk-memory of this machine (GB), for the planner;
    the host: MemAvailable less `host_margin`; the disk: 95% of what is free under
    `nvme_path`."""
    if dry:
        return ["--gpu-memory", "80", "--host-memory", "125", "--disk-memory", "64"]
    import torch

    from megazoo.offload import host_memory_bytes

    free, _ = torch.cuda.mem_get_info()
    out = ["--gpu-memory", f"{free / 1e9:.1f}",
           "--host-memory", f"{(host_memory_bytes() or 0) / 1e9 - host_margin:.1f}"]
    if nvme_path:
        out += ["--disk-memory", f"{shutil.disk_usage(nvme_path).free / 1e9 * 0.95:.1f}"]
    return out


def plan_largest(budgets: list[str], flags: list[str], timeout: float = 120) -> dict:
    """The planner's answer ({"command", "num_parameters", ...}) or {"error": ...}."""
    cmd = [sys.executable, "-m", "megazoo.plan", "--largest", "--model-family", "llama",
           "--seq-length", "2048", *budgets, *flags, "--save", "", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(),
                          timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip()[-400:]}
    return json.loads(proc.stdout)


def plan_target(budgets: list[str], flags: list[str], caps=DISK_CAPS,
                target: float = TARGET) -> dict:
    """The planner's largest with the disk share capped, under the smallest of `caps` (GB)
    whose answer reaches `target` parameters, else under the whole free disk: the state on
    disk is read and written once per step, so the smallest share that reaches the target
    is the fastest run that does. Without a --disk-memory: `plan_largest` as it is."""
    if "--disk-memory" not in budgets:
        return plan_largest(budgets, flags)
    at = budgets.index("--disk-memory") + 1
    free = float(budgets[at])
    for cap in [c for c in caps if c < free] + [free]:
        planned = plan_largest(budgets[:at] + [f"{cap:g}"] + budgets[at + 1:], flags)
        planned["disk_cap_gb"] = cap
        if planned.get("num_parameters", 0) >= target:
            break
    return planned


def planned_fraction(budgets: list[str], shape_flags: list[str], gb: int) -> float | None:
    """The lowest --optimizer-offload-fraction (steps of 0.05) at which the planner says the
    bf16-gradient offload run of `shape_flags` fits this GPU: the GPU as full as it plans."""
    from megazoo.plan.layout import PlanOptions
    from megazoo.plan.memory import estimate_memory
    from megazoo.config.flags import parse_args

    opts = dict(zip(budgets[::2], budgets[1::2]))
    options = PlanOptions(gpu_memory=float(opts["--gpu-memory"]),
                          host_memory=float(opts.get("--host-memory", 0)), gpus_per_node=1)
    for k in range(21):
        fraction = k / 20
        args = parse_args(shape_flags + ["--global-batch-size", str(gb), "--bf16", *PLAIN,
                                         "--optimizer-offload-fraction", str(fraction)])
        if estimate_memory(args, options).fits:
            return fraction
    return None


def run_flags(command: str) -> list[str]:
    """The planner's `python pretrain_gpt.py ...` as flags, without the batch sizes."""
    words, out, skip = shlex.split(command)[2:], [], False
    for w in words:
        if skip:
            skip = False
        elif w in DROP:
            skip = True
        else:
            out.append(w)
    return out


def largest_rows(name: str, planned: dict, gbs: list[int], iters: int, dry: bool,
                 left, pretrain_row, tiny: dict, dry_flags: list[str] | None = None) -> list[dict]:
    """Train the planned model `iters` steps at each global batch size (micro-batch 1). The
    dry run trains the tiny shape with `dry_flags` (default: the planned engine flags)."""
    if "error" in planned:
        return [{"row": name, "error": planned["error"]}]
    flags = run_flags(planned["command"])
    nvme = flags[flags.index("--nvme-path") + 1] if "--nvme-path" in flags else None
    if dry and dry_flags is not None:
        flags = dry_flags
    elif dry:  # the plumbing only: the tiny shape with the planned engine flags
        keep = [f for f in ("--optimizer-cpu-offload", "--accumulate-grads-in-bf16",
                            "--deepspeed") if f in flags]
        flags = keep + (["--zero-stage", "3"] if "--deepspeed" in keep else [])
        flags += ["--nvme-path", nvme, *DRY_SPLIT] if nvme else []
    # lr 3e-5 without warmup: at the default 3e-3, and still at 3e-4, a 14B model's loss
    # jumps at steps 2-9 of a 4-sequence batch (26.1, 37.5, 49.5 from 8.9); the overlapped
    # offload for the plain engine
    extra = ["--lr", "3e-5", "--min-lr", "3e-6", "--lr-warmup-iters", "0"]
    extra += ["--overlap-cpu-optimizer-d2h-h2d"] if "--optimizer-cpu-offload" in flags else []
    rows = []
    for gb in gbs:
        shape = {**tiny, "micro": 1, "flags": None if dry else flags, "seq": tiny["seq"] if dry
                 else 2048}
        row = pretrain_row(f"{name} gb {gb}", shape, gb, iters, (flags if dry else []) + extra,
                           dry, left() / max(len(gbs) - len(rows), 1))
        row["num_parameters"] = planned.get("num_parameters")
        row["planned_command"] = planned["command"]
        row["planned_disk_gb"] = planned.get("disk_per_gpu", 0) / 1e9
        row["planned_host_gb"] = planned.get("host_per_gpu", 0) / 1e9
        row["disk_gb"] = disk_bytes(nvme) / 1e9 if nvme else 0.0  # the store's files
        losses = [x for x in row.get("losses", []) if x == x]
        row["loss_first"], row["loss_last"] = (losses[0], losses[-1]) if losses else (None, None)
        row["loss_falls"] = bool(losses) and losses[-1] < losses[0]
        rows.append(row)
    return rows


def disk_bytes(path: str) -> int:
    """Bytes allocated by the files under `path` (the disk tier leaves them at exit)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path)
               for f in files)


def disk_rates(path: str, dry: bool, nbytes: int = 2 ** 31) -> dict:
    """The disk's sequential write and read rates under `path` (GB/s): one file of `nbytes`
    (64 MiB dry) written and read back through the disk store's own O_DIRECT I/O."""
    from megazoo.training.backends.state_store import NvmeStateStore

    numel = (2 ** 26 if dry else nbytes) // 12
    store = NvmeStateStore(os.path.join(path, "rate-probe"), [numel], slots=1, pin=False)
    store.acquire(0)["master"].fill_(1.0)
    t0 = time.perf_counter()
    store.release(0)
    store.flush()
    write = time.perf_counter() - t0
    store._slots[0].shard = None  # forget the staged copy: the next acquire reads the file
    t0 = time.perf_counter()
    store.acquire(0)
    read = time.perf_counter() - t0
    shutil.rmtree(os.path.join(path, "rate-probe"), ignore_errors=True)
    size = store.nbytes / 1e9
    return {"row": "disk rates", "bytes": store.nbytes, "direct_io": store.direct,
            "write_gb_per_s": size / write, "read_gb_per_s": size / read}


def nvme_dir(path: str | None) -> str | None:
    """`path` made, without the disk tier's folders an earlier run left there (rank*/: their
    files would hide free disk from the budget)."""
    if path:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.startswith("rank") and os.path.isdir(os.path.join(path, name)):
                shutil.rmtree(os.path.join(path, name))
    return path
