"""Where a `pretrain_gpt.py` step spends its time: torch.profiler over a few steps of the real run.

    python -m bench.profile_train [--steps 3 --skip 5 --rows 20] -- <pretrain_gpt.py flags>
    torchrun --nproc-per-node 2 -m bench.profile_train --out prof.json -- <flags>   # dp = 2

Runs the training entry point in this process and wraps the engines' shared `train_step`:
steps `skip` .. `skip + steps - 1` are recorded (CPU and CUDA activity), then the table of
operators and kernels by device self time is printed, with the step time and the share of
it in which a kernel ran (the sum over kernels; operators repeat their kernels' time).

Under torchrun every rank profiles its own steps and rank 0 prints and writes its own. Exposed
communication per step: the time in which a collective ran and no compute did, from the
recorded intervals. On GPUs communication is a kernel whose name holds "nccl" or "c10d::"
(symmetric memory's barriers) and a peer-to-peer copy (the copy engines' transfers under
--tp-comm-overlap's fused ops); compute is every other kernel and copy, so it is the
communication time no other kernel hides. On CPU
(gloo) there are no kernels; the proxy is the collective's host-side events (names holding
"gloo", "nccl" or "c10d::") against the `aten::` operators: rough, it only checks the path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

COMM_MARKS = ("nccl", "gloo", "c10d::", "memcpy ptop")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def exposed_communication(events, on_gpu: bool) -> tuple[float, float]:
    """(communication us, exposed communication us) over the recorded events: the union of
    collective intervals, and the part of it that no compute interval covers."""
    comm, compute = [], []
    for e in events:
        name = e.name.lower()
        is_comm = any(m in name for m in COMM_MARKS)
        if on_gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not on_gpu and not (is_comm or e.name.startswith("aten::")):
            continue
        (comm if is_comm else compute).append((e.time_range.start, e.time_range.end))
    comm, compute = _union(comm), _union(compute)
    covered, j = 0.0, 0
    for start, end in comm:  # both sorted and disjoint: one sweep
        while j < len(compute) and compute[j][1] <= start:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < end:
            covered += min(end, compute[k][1]) - max(start, compute[k][0])
            k += 1
    return _length(comm), _length(comm) - covered


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--out", default=None, help="write the step summary as JSON here (rank 0)")
    p.add_argument("--gaps", type=int, default=0, metavar="ROWS",
                   help="also record Python stacks and print where the device idles "
                        "(bench.gap_report), this many rows")
    p.add_argument("--trace", default=None, help="keep the Chrome trace here (with --gaps)")
    args = p.parse_args(argv[:split])
    run_flags = argv[split + 1:]

    from torch.profiler import ProfilerActivity, profile

    from megazoo.training.backends.base import Engine
    from megazoo.training.run import main as run_main

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, with_stack=bool(args.gaps))
    original, seen, wall = Engine.train_step, [0], [0.0]

    def train_step(self, micro_batches):
        seen[0] += 1
        recording = args.skip < seen[0] <= args.skip + args.steps
        if seen[0] == args.skip + 1:
            prof.start()
        if recording:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        result = original(self, micro_batches)
        if recording:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall[0] += time.perf_counter() - t0
        if seen[0] == args.skip + args.steps:
            prof.stop()
        return result

    Engine.train_step = train_step
    rc = run_main(run_flags)
    if seen[0] < args.skip + args.steps:
        print(f"the run made {seen[0]} steps; give --train-iters >= {args.skip + args.steps}")
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        summary = report(prof, wall[0], args.steps, args.rows)
        if args.gaps:
            summary["gaps"] = _gaps(prof, args.gaps, args.trace)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=2)
    return rc


def _gaps(prof, rows: int, keep: str | None) -> dict:
    import tempfile

    from bench.gap_report import report as gap_report

    with tempfile.TemporaryDirectory() as tmp:
        path = keep or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return gap_report(path, rows)


def busy_us(events, on_gpu: bool) -> float:
    """The device's busy time over `events` (key_averages): the kernels' own time (an
    operator's device time repeats its kernels'); without kernels, every event's CPU time."""
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] or events
    return sum(getattr(e, key) for e in kernels)


def report(prof, wall_s: float, steps: int, rows: int) -> dict:
    """Print the step time, device busy share, exposed communication and the op table."""
    on_gpu = torch.cuda.is_available()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = prof.key_averages()
    busy = busy_us(events, on_gpu)
    step_ms = wall_s / steps * 1e3
    comm_us, exposed_us = exposed_communication(prof.events(), on_gpu)
    summary = {"step_ms": step_ms, "busy_ms": busy / 1e3 / steps,
               "comm_ms": comm_us / 1e3 / steps, "exposed_comm_ms": exposed_us / 1e3 / steps,
               "proxy": ("nccl, barrier kernels and peer copies vs other kernels" if on_gpu
                         else "gloo host events vs aten ops"),
               "world": int(os.environ.get("WORLD_SIZE", "1"))}
    print(f"step {step_ms:.1f} ms; device busy {summary['busy_ms']:.1f} ms per step "
          f"({100 * summary['busy_ms'] / step_ms:.0f}%); communication {summary['comm_ms']:.1f} ms, "
          f"exposed {summary['exposed_comm_ms']:.1f} ms per step ({summary['proxy']})")
    print("| op | calls/step | ms/step | % of step |")
    print("|---|---|---|---|")
    for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]:
        ms = getattr(e, key) / 1e3 / steps
        print(f"| {e.key[:60]} | {e.count / steps:.0f} | {ms:.1f} | {100 * ms / step_ms:.1f} |")
    return summary


if __name__ == "__main__":
    sys.exit(main())
