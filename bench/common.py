"""Shared helpers of the benchmarks: timing (CUDA events on GPUs), tables, JSON output, and
the command line of a benchmark run as a child process.

Conventions (bench/README.md): warm up, then take the median of several timed steps; random
data, never zeros; MFU against the bf16 matmul ceiling measured in the same run. Model FLOPs
and that ceiling are the library's own (`megazoo.models.flops.flops_per_iteration`,
`megazoo.training.metrics.measure_peak_tflops`), so a benchmark reports what the run logs.

Every benchmark is a module of the `bench` package, run from the repository root:
`python -m bench.model_bench`, `torchrun --nproc-per-node 2 -m bench.ulysses_bench`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import torch

#: The repository root: children run there, with it first on PYTHONPATH.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of `fn()` in milliseconds, after `warmup` untimed calls.

    On CUDA each call is bracketed by CUDA events (no host overhead between launches is
    hidden); elsewhere by perf_counter around a synchronised call.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_cuda(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of `fn()` on the current CUDA device (see `time_ms`)."""
    return time_ms(fn, torch.device("cuda"), warmup, iters) / 1e3


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A fixed-width table of `rows` (dicts), one column per key in `columns`."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def write_json(path: str | None, payload) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}", flush=True)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


# A bench child prints its row as one line: RESULT {json}; the parent reads it back.
RESULT = "RESULT "


def results(stdout: str) -> list:
    """The JSON of every `RESULT {json}` line of a child's stdout, in order."""
    return [json.loads(line[len(RESULT):]) for line in stdout.splitlines()
            if line.startswith(RESULT)]


def child_env(**extra: str) -> dict:
    """This process's environment with the repository first on PYTHONPATH (for children)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def module_command(module: str, launcher: list[str] | None = None) -> list[str]:
    """The command that runs `bench.<module>` (under `launcher`, e.g. torchrun, if given)."""
    return (launcher or [sys.executable]) + ["-m", f"bench.{module}"]


def torchrun(nproc: int) -> list[str]:
    """The launcher of `nproc` local ranks (torchrun, standalone: a free port of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc)]


def run_command(cmd: list[str], timeout: float | None = None, **kwargs) -> tuple[int | None, str, str]:
    """(return code, stdout, stderr) of `cmd` run from the repository root with `child_env()`;
    return code None when it ran past `timeout` seconds, after which its whole process group
    (a launcher's ranks too) is killed."""
    kwargs.setdefault("cwd", REPO)
    kwargs.setdefault("env", child_env())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def failure_line(stderr: str, limit: int = 300) -> str:
    """The line of a failed child's stderr that says why: its last "error: ..." line, else its
    last exception line other than a launcher's report (ChildFailedError), else the tail."""
    lines = [re.sub(r"^\[[^\]]*\]:?\s*", "", x.strip()) for x in stderr.splitlines() if x.strip()]
    said = [x for x in lines if re.match(r"([\w.]+: )?error:", x)]  # "prog: error: ..." too
    raised = [x for x in lines if re.match(r"[\w.]+(Error|Exception)\b", x) and "ChildFailed" not in x]
    if said or raised:
        return (said or raised)[-1][-limit:]
    return " ".join(" ".join(lines).split())[-limit:]
