"""Does a transfer issued next to a long attention kernel run beside it or after it? One GPU.

    python -m bench.stream_priority_probe --out priority.json
    python -m bench.stream_priority_probe --backends default --green-sms 0 124 --out p.json
    python -m bench.stream_priority_probe --dry-run      # CPU: checks the script only

The overlapped Ulysses pipeline (experimental/ulysses_overlap.py) issues chunk c+1's all-to-all while
chunk c's attention runs. That only overlaps if the all-to-all's kernels get SMs while the
attention kernel runs. This probe stands in for them with a copy of one chunk's payload
(1/chunks of 16 heads' q, k, v; 16 heads x 128 is what one rank of two attends), issued on a
side stream while causal SDPA runs on the compute stream, and reports when the copy finishes:

- backend rows, for each SDPA backend (`default` = what SDPA picks, `flash`, `cudnn`,
  `efficient`) and each copy: `copy_kernel` (an elementwise kernel on the SMs, as NCCL's are),
  `memcpy` (`cudaMemcpyAsync` device to device) and `h2d` (pinned host to device, a copy
  engine), from a normal- and a high-priority side stream, issued after the attention or
  `gated` (issued first, behind a ~1 ms spin, so it becomes ready mid-attention);
- green rows: the default SDPA confined to `--green-sms` SMs with a CUDA green context, its
  time alone and whether a copy kernel beside it (on the whole device) now runs at once.

`done_ms` = time from the start of the attention to the end of the copy, `att_ms` = the
attention's end, `host_ms` = how long issuing the attention held the host. A copy that runs
beside the attention finishes near its own time alone; a serialised one near att_ms.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, time_ms, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4, help="the payload is 1/chunks of the heads' q, k, v")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["default", "flash", "cudnn", "efficient"],
                   help="SDPA backends to probe (default: whatever SDPA picks)")
    p.add_argument("--green-sms", type=int, nargs="*", default=[0, 128, 124, 120, 112],
                   help="SM counts for the green-context rows (0: no green context)")
    p.add_argument("--skip-backends", action="store_true", help="only the green-context rows")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out")
    return p.parse_args(argv)


def _copy(kind: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if kind == "h2d":  # pinned host to device: a copy engine, no SMs
        dst.copy_(_pinned(src), non_blocking=True)
    elif kind == "memcpy":
        dst.copy_(src)  # contiguous, same dtype and device: cudaMemcpyAsync
    else:
        torch.mul(src, 1, out=dst)  # an elementwise kernel on the SMs


def green(attend, num_sms: int | None):
    """attend() restricted to num_sms SMs through a CUDA green context (None: all SMs)."""
    if num_sms is None:
        return attend
    ctx = torch.cuda.green_contexts.GreenContext.create(num_sms=num_sms, device_id=0)

    def run():
        ctx.set_context()
        try:
            return attend()
        finally:
            ctx.pop_context()
    return run


def probe_green(s: int, args) -> list[dict]:
    """Default SDPA confined to fewer SMs: its time alone, and whether a copy kernel issued
    beside it on the full device now runs at once."""
    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    src = torch.randn(s * 3 * args.heads * args.head_dim // args.chunks, device="cuda",
                      dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    device, rows = torch.device("cuda"), []
    for num_sms in args.green_sms:
        try:
            attend = green(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), num_sms)
            alone = time_ms(attend, device, 2, args.iters)
        except (RuntimeError, AttributeError, TypeError) as e:
            print(f"green context with {num_sms} SMs: {e}")
            continue
        runs = [_concurrent(attend, "copy_kernel", dst, src, 0, False) for _ in range(args.iters + 1)][1:]
        att_ms, done_ms, _ = (statistics.median(r[i] for r in runs) for i in range(3))
        rows.append({"seq": s, "green_sms": num_sms or "all", "att_alone_ms": alone,
                     "att_ms": att_ms, "done_ms": done_ms})
    return rows


def _concurrent(attend, kind, dst, src, priority: int, gated: bool) -> tuple[float, float, float]:
    """(att_ms, done_ms, host_ms) of attention on the current stream with the copy beside it:
    issued after the attention (host_ms: how long issuing the attention held the host), or
    `gated`: issued first on the side stream behind a ~1 ms one-thread spin, so the copy
    becomes ready on the GPU while the attention runs, whatever the host does."""
    side = torch.cuda.Stream(priority=priority)
    start, att_end, copy_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    if gated:
        side.wait_event(start)
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # ~1 ms at ~2 GHz
            _copy(kind, dst, src)
            copy_end.record()
    t0 = time.perf_counter()
    attend()
    host_ms = (time.perf_counter() - t0) * 1e3
    att_end.record()
    if not gated:
        side.wait_event(start)
        with torch.cuda.stream(side):
            _copy(kind, dst, src)
            copy_end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(att_end), start.elapsed_time(copy_end), host_ms


_PINNED: dict = {}


def _pinned(like: torch.Tensor) -> torch.Tensor:
    if like.numel() not in _PINNED:
        _PINNED[like.numel()] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return _PINNED[like.numel()]


BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def _kernels(fn) -> list[str]:
    """Names of the CUDA kernels `fn` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def probe_seq(s: int, backend: str, args) -> list[dict]:
    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    src = torch.randn(s * 3 * args.heads * args.head_dim // args.chunks, device="cuda",
                      dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def attend():
        if backend == "default":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        chosen = getattr(torch.nn.attention.SDPBackend, BACKENDS[backend])
        with torch.nn.attention.sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        kernels = _kernels(attend)
    except RuntimeError as e:
        print(f"{backend} at s={s}: {str(e).splitlines()[0]}")
        return []
    print(f"{backend} at s={s}: {kernels}")

    device = torch.device("cuda")
    att_alone = time_ms(attend, device, 2, args.iters)
    rows = []
    for kind in ("copy_kernel", "memcpy", "h2d"):
        alone = time_ms(lambda: _copy(kind, dst, src), device, 2, args.iters)
        # lower number = higher priority; priority_range() = (least, greatest), e.g. (0, -5)
        least, greatest = torch.cuda.Stream.priority_range()
        for (name, priority), gated in itertools.product((("normal", least), ("high", greatest)),
                                                         (False, True)):
            runs = [_concurrent(attend, kind, dst, src, priority, gated) for _ in range(args.iters + 1)][1:]
            att_ms, done_ms, host_ms = (statistics.median(r[i] for r in runs) for i in range(3))
            rows.append({"seq": s, "backend": backend, "copy": kind, "stream": name, "gated": gated,
                         "payload_MB": src.numel() * 2 / 1e6, "att_alone_ms": att_alone,
                         "copy_alone_ms": alone, "att_ms": att_ms, "done_ms": done_ms,
                         "host_ms": host_ms, "serialised": done_ms > 0.5 * att_ms + alone})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run or not torch.cuda.is_available():
        print("stream_priority_probe needs a CUDA GPU; nothing to measure here")
        return 0
    args.green_sms = [n or None for n in args.green_sms]
    green_rows = [r for s in args.seqs for r in probe_green(s, args)]
    print_table(green_rows, ["seq", "green_sms", "att_alone_ms", "att_ms", "done_ms"])
    rows = [] if args.skip_backends else [r for s in args.seqs for b in args.backends
                                          for r in probe_seq(s, b, args)]
    if rows:
        print_table(rows, ["seq", "backend", "copy", "stream", "gated", "payload_MB", "att_alone_ms",
                           "copy_alone_ms", "att_ms", "done_ms", "host_ms", "serialised"])
    write_json(args.out, {"env": environment(torch.device("cuda")), "args": vars(args),
                          "green": green_rows, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
