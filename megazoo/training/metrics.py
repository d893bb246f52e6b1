"""Training metrics: the log line, JSON lines, TensorBoard / Weights & Biases
(`log_writers.py`), TFLOP/s and MFU, memory.

TFLOP/s = F / seconds per iteration / 1e12, summed over all devices (F: the model FLOPs of
an iteration, `megazoo.models.flops`); MFU divides the per-device rate by `--peak-tflops`,
or by a bf16 matmul ceiling measured once at start (GPU only; on CPU MFU is not reported).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from ..errors import user_path
from ..plot import METRICS_FILE  # the run's metrics in its --save folder, appended on resume
from .log_writers import open_writers


def measure_peak_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """A bf16 matmul's achieved TFLOP/s on `device` (None on CPU: no MFU there)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def host_rss_gb() -> float:
    """Peak resident memory of this process, GB (1e9 bytes; Linux counts ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


class MetricsLogger:
    """Formats, prints (rank 0) and records metrics; `write` takes a dict of numbers.

    Records are appended as JSON lines to --log-json and, with `metrics_dir` (the --save
    folder of a training run), to `metrics_dir/metrics.jsonl`."""

    def __init__(self, logging_cfg, device: torch.device, is_rank0: bool, print_fn=print,
                 save_dir: str | None = None, run_config: dict | None = None,
                 metrics_dir: str | None = None, start_iteration: int = 0):
        self.device, self.is_rank0, self.print = device, is_rank0, print_fn
        self.sinks, self.writers = [], []  # (flag, path, open file) of each JSON-lines file
        self.records: list[dict] = []  # this segment's, kept to tell whether it logged any
        self.metrics_path = os.path.join(metrics_dir, METRICS_FILE) if metrics_dir else None
        if is_rank0 and self.metrics_path:
            with user_path("--save", self.metrics_path):
                drop_records_after(self.metrics_path, start_iteration)
        if is_rank0:
            for flag, path in (("--log-json", logging_cfg.log_json),
                               ("--save", self.metrics_path)):
                if path:  # appended to, its folder created; an OSError is one line
                    with user_path(flag, path):
                        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                        self.sinks.append((flag, path, open(path, "a")))
            self.writers = open_writers(logging_cfg, save_dir, run_config or {}, print_fn)
        self.peak = logging_cfg.peak_tflops
        if self.peak is None:
            self.peak = measure_peak_tflops(device)

    def memory(self) -> dict:
        out = {"host_rss_gb": round(host_rss_gb(), 3)}
        if self.device.type == "cuda":
            out["gpu_max_allocated_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 1e9, 3)
        return out

    def throughput(self, flops: float, seconds: float, world: int, tokens: int) -> dict:
        out = {"tokens_per_s": tokens / seconds}
        if self.device.type == "cuda":
            tflops = flops / seconds / 1e12
            out["tflops"] = tflops
            if self.peak:
                out["mfu"] = tflops / world / self.peak
        return out

    def write(self, record: dict, show: bool = True) -> None:
        """One log record (rank 0): printed as a line, appended as JSON, and, when it has an
        iteration, its numbers sent to TensorBoard / Weights & Biases."""
        if not self.is_rank0:
            return
        if show:
            self.print(" | ".join(_fmt(k, v) for k, v in record.items()))
        for flag, path, file in self.sinks:
            with user_path(flag, path):  # a disk that fills up mid-run: one line
                file.write(json.dumps(record) + "\n")
                file.flush()
        if "iteration" not in record:
            return
        self.records.append(record)
        numbers = {k: v for k, v in record.items() if k != "iteration" and v == v
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for writer in self.writers:
            writer.scalars(numbers, record["iteration"])

    def close(self) -> None:
        for _, _, file in self.sinks:
            try:
                file.close()
            except OSError:
                pass  # a full disk was reported when the record was written
        for writer in self.writers:
            writer.close()
        self.sinks, self.writers = [], []


def speed_note(remaining: int, step_s: float, threads: int, cores: int, load: float,
               threads_given: bool) -> str:
    """What the first log line of a CPU run adds: how long the remaining steps take at this
    speed, and, when other work keeps the cores busy (the 1-minute load average less this
    run's own threads), how many threads to ask for: torch's default of one a core makes them
    fight that work, which on a loaded machine is several times slower."""
    minutes = remaining * step_s / 60
    note = f"at this speed the remaining {remaining} steps take about {minutes:.0f} min"
    free = max(1, cores - round(max(0.0, load - threads)))
    if not threads_given and free < threads:
        note += (f"; the machine is busy (load average {load:.1f} on {cores} cores): "
                 f"--cpu-threads {free} is likely faster than the {threads} threads now")
    return note


def drop_records_after(path: str, iteration: int) -> None:
    """Rewrite the JSON-lines file `path` without the records of iterations after
    `iteration`: what a killed segment logged past its last checkpoint, which the run resumed
    there logs again (each iteration then appears once in the file)."""
    def later(line: str) -> bool:
        try:
            record = json.loads(line)
        except ValueError:
            return False
        return isinstance(record, dict) and isinstance(record.get("iteration"), int) \
            and record["iteration"] > iteration

    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    keep = [line for line in lines if not later(line)]
    if len(keep) != len(lines):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key in ("lr",):
            return f"{key} {value:.3e}"
        return f"{key} {value:.4g}" if abs(value) < 1e3 else f"{key} {value:,.0f}"
    return f"{key} {value}"
