"""Where a `pretrain_gpt.py` step spends its time: torch.profiler over a few steps of the real run.

    python -m bench.profile_train [--steps 3 --skip 5 --rows 20] -- <pretrain_gpt.py flags>

Runs the training entry point in this process and wraps the engines' shared `train_step`:
steps `skip` .. `skip + steps - 1` are recorded (CPU and CUDA activity), then the table of
operators and kernels by device self time is printed, with the step time and the share of
it in which a kernel ran (the sum over kernels; operators repeat their kernels' time).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--rows", type=int, default=20)
    args = p.parse_args(argv[:split])
    run_flags = argv[split + 1:]

    from torch.profiler import ProfilerActivity, profile

    from megazoo.training.backends.base import Engine
    from megazoo.training.run import main as run_main

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
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
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    events = prof.key_averages()
    # Kernels (device events) only: an operator's device time repeats its kernels' time.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] or events
    busy_us = sum(getattr(e, key) for e in kernels)
    step_ms = wall[0] / args.steps * 1e3
    print(f"step {step_ms:.1f} ms; device busy {busy_us / 1e3 / args.steps:.1f} ms per step "
          f"({100 * busy_us / 1e3 / args.steps / step_ms:.0f}%)")
    print("| op | calls/step | ms/step | % of step |")
    print("|---|---|---|---|")
    for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:args.rows]:
        ms = getattr(e, key) / 1e3 / args.steps
        print(f"| {e.key[:60]} | {e.count / args.steps:.0f} | {ms:.1f} | {100 * ms / step_ms:.1f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
