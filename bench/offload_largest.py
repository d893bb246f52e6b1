"""The largest model this machine trains, as `python -m megazoo.plan --largest` answers it,
trained for real: bench/offload_bench.py's `--largest` and `--peer-largest` rows, and the
fraction its `bf16grads` rows use.

    planned = plan_largest(budgets, flags)     # {"command": ..., "num_parameters": ...}
    rows = largest_rows(name, planned, gbs, iters, dry, left)

The budgets are this machine's: free GPU memory, MemAvailable of the host, free disk under
--nvme-path (GB, 1e9 bytes). The plain engine asks with --optimizer-cpu-offload
--accumulate-grads-in-bf16 --nvme-path DIR; the peer (DeepSpeed ZeRO-3) with its CPU
optimizer and parameter offload (the planner models DeepSpeed's cpu offload, not its nvme).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

from bench.common import REPO, child_env

PLAIN = ["--optimizer-cpu-offload", "--accumulate-grads-in-bf16"]
PEER = ["--deepspeed", "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"]
DROP = {"--global-batch-size", "--micro-batch-size"}  # the rows set their own


def machine_budgets(nvme_path: str | None, dry: bool) -> list[str]:
    """--gpu-memory / --host-memory / --disk-memory of this machine (GB), for the planner."""
    if dry:
        return ["--gpu-memory", "80", "--host-memory", "125", "--disk-memory", "64"]
    import torch

    from megazoo.plan.offload import host_memory_bytes

    free, _ = torch.cuda.mem_get_info()
    out = ["--gpu-memory", f"{free / 1e9:.1f}",
           "--host-memory", f"{(host_memory_bytes() or 0) / 1e9:.1f}"]
    if nvme_path:
        out += ["--disk-memory", f"{shutil.disk_usage(nvme_path).free / 1e9 * 0.95:.1f}"]
    return out


def plan_largest(budgets: list[str], flags: list[str], timeout: float = 120) -> dict:
    """The planner's answer ({"command", "num_parameters", ...}) or {"error": ...}."""
    cmd = [sys.executable, "-m", "megazoo.plan", "--largest", "--model-family", "llama",
           "--seq-length", "2048", *budgets, *flags, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(),
                          timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip()[-400:]}
    return json.loads(proc.stdout)


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
                 left, pretrain_row, tiny: dict) -> list[dict]:
    """Train the planned model `iters` steps at each global batch size (micro-batch 1)."""
    if "error" in planned:
        return [{"row": name, "error": planned["error"]}]
    flags = run_flags(planned["command"])
    if dry:  # the plumbing only: the tiny shape with the planned engine flags
        keep = [f for f in ("--bf16", "--optimizer-cpu-offload", "--accumulate-grads-in-bf16",
                            "--deepspeed") if f in flags]
        flags = keep + (["--zero-stage", "3"] if "--deepspeed" in keep else [])
        flags = [f for f in flags if f != "--bf16"]
    # a gentler lr than the default's 3e-3 without warmup (a spike at step 2 on large
    # models), and the overlapped offload for the plain engine
    extra = ["--lr", "3e-4", "--lr-warmup-iters", "2"]
    extra += ["--overlap-cpu-optimizer-d2h-h2d"] if "--optimizer-cpu-offload" in flags else []
    rows = []
    for gb in gbs:
        shape = {**tiny, "micro": 1, "flags": None if dry else flags, "seq": tiny["seq"] if dry
                 else 2048}
        row = pretrain_row(f"{name} gb {gb}", shape, gb, iters, (flags if dry else []) + extra,
                           dry, left() / max(len(gbs) - len(rows), 1))
        row["num_parameters"] = planned.get("num_parameters")
        row["planned_command"] = planned["command"]
        losses = [x for x in row.get("losses", []) if x == x]
        row["loss_falls"] = bool(losses) and losses[-1] < losses[0]
        rows.append(row)
    return rows


def nvme_dir(path: str | None) -> str | None:
    if path:
        os.makedirs(path, exist_ok=True)
    return path
