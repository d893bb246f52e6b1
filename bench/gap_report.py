"""Where the GPU idles, from a torch.profiler Chrome trace: every gap between device kernels,
attributed to what the host was doing while it lasted.

    python -m bench.profile_train --gaps 25 -- <pretrain_gpt.py flags>   # writes and reads a trace
    python -m bench.gap_report TRACE.json [--rows 25]                     # an existing trace

A gap is an interval in which no kernel, copy or memset ran on any stream. The kernel that
ends it was launched by some host thread (matched by the trace's correlation id); the gap is
charged to the innermost Python frames of that thread at the gap's middle (the profiler's
`with_stack` frames; the innermost `cpu_op` when there are none). A gap whose ending kernel
was launched before the gap began is a dependency wait (an event or a stream), not a late
launch. The table sums the gaps per frame chain: the host code the device waited for.
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")


def _device_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    out = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events if e.get("cat") in DEVICE_CATS]
    return sorted(out, key=lambda t: t[0])


def _gaps(intervals, min_us: float):
    """(start, end, kernel after the gap) for each idle interval of at least `min_us`."""
    end = None
    for start, stop, ev in intervals:
        if end is not None and start - end >= min_us:
            yield end, start, ev
        end = stop if end is None else max(end, stop)


class _Frames:
    """Per host thread: the python frames / cpu ops, to find the innermost ones at a time."""

    def __init__(self, events: list[dict]):
        self.by_tid = defaultdict(list)
        stacks = [e for e in events if e.get("cat") == "python_function"]
        chosen = stacks or [e for e in events if e.get("cat") == "cpu_op"]
        for e in chosen:
            self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        for spans in self.by_tid.values():
            spans.sort()

    def at(self, tid, t: float, depth: int) -> str:
        spans = self.by_tid.get(tid, [])
        i = bisect.bisect_right(spans, (t, float("inf"), ""))
        enclosing = [s for s in spans[max(0, i - 4000):i] if s[0] <= t <= s[1]]
        names = [n for _, _, n in sorted(enclosing, key=lambda s: s[1] - s[0])]
        useful = [n for n in names if "megazoo" in n or "bench" in n] or names
        return " < ".join(useful[:depth]) or "(no host frame)"


def report(trace_path: str, rows: int = 25, min_us: float = 5.0, depth: int = 2) -> dict:
    """Print the gap table of a Chrome trace; return totals (us) and the rows."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in HOST_CATS and "correlation" in e.get("args", {})}
    intervals = _device_intervals(events)
    if not intervals:
        print("no device activity in the trace")
        return {}
    frames = _Frames(events)
    span = intervals[-1][1] - intervals[0][0]
    charged, late, waits = defaultdict(float), 0.0, 0.0
    for start, end, ev in _gaps(intervals, min_us):
        launch = launches.get(ev.get("args", {}).get("correlation"))
        if launch is None or launch["ts"] < start:
            waits += end - start
            charged["(dependency wait: launched before the gap)"] += end - start
            continue
        late += end - start
        charged[frames.at(launch["tid"], (start + end) / 2, depth)] += end - start
    idle = late + waits
    print(f"device span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms ({100 * idle / span:.1f}%) "
          f"in gaps >= {min_us:g} us: late launches {late / 1e3:.1f} ms, waits {waits / 1e3:.1f} ms")
    print("| host frames while the device waited | ms | % of span |\n|---|---|---|")
    table = sorted(charged.items(), key=lambda kv: kv[1], reverse=True)[:rows]
    for name, us in table:
        print(f"| {name[:110]} | {us / 1e3:.2f} | {100 * us / span:.1f} |")
    return {"span_us": span, "idle_us": idle, "late_us": late, "wait_us": waits,
            "rows": [{"frames": n, "us": us} for n, us in table]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--min-us", type=float, default=5.0)
    p.add_argument("--depth", type=int, default=2)
    args = p.parse_args(argv)
    report(args.trace, args.rows, args.min_us, args.depth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
