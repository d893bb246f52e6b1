"""A tensor-parallel block's GEMMs with their Megatron-SP collectives, per GEMM and path.

    torchrun --nproc-per-node 2 -m bench.async_tp_probe --out $OUT/async_tp.json   # 2 or 4 GPUs
    python -m bench.async_tp_probe --dry-run                                     # CPU, gloo

With CUDA graphs the host no longer sets tp's pace; the all-gathers and reduce-scatters do,
run back to back with the GEMMs (bench/results/cuda_graphs_h200_2026-11-28.md). This times,
at one block's shapes (T tokens of width h, MLP width f, tp t = the ranks), each column GEMM
with its input all-gathered first (QKV [T, h] x [h, 3h/t], MLP in [T, h] x [h, f/t]) and
each row GEMM with its output reduce-scattered after (attention out [T, h/t] x [h/t, h],
MLP out [T, f/t] x [f/t, h]):
- `gemm`: the GEMM alone, the floor;
- `nccl`: the collective then the GEMM, megazoo's path without --tp-comm-overlap
  (`layers.tp_overlap`, one call);
- `overlap`: megazoo's --tp-comm-overlap path: on CUDA over NCCL torch's fused
  symmetric-memory ops (`layers.symm_tp`: copy-engine transfers beside the GEMM, NVLink
  multicast off), on gloo the 4-chunk pipeline;
- `beside` (row GEMMs): the GEMM and an independent reduce-scatter of its output's size on a
  second stream, issued together: near the longer of the two where they overlap, near
  their sum where NCCL's kernels wait for the SMs the GEMM holds (the planner's
  `overlap_hidden`).
Each variant's result is checked against `nccl`'s (`beside`'s against the GEMM's; relative
max error printed), and timed with CUDA events over `--iters` runs after a warm-up, eagerly
and (on CUDA) captured in a CUDA graph and replayed, as `--enable-cuda-graph` runs it. Rank
0 prints a table, µs per call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from megazoo.layers.tp_overlap import TP_COMM_CHUNKS, gather_matmul, matmul_reduce_scatter


def _timed(fn, iters: int, cuda: bool) -> float:
    """µs per call of fn() (CUDA events, or the wall clock on CPU)."""
    for _ in range(3):
        fn()
    if not cuda:
        import time
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def _graphed(fn, iters: int) -> float:
    """µs per replay of fn() captured in a CUDA graph (fn has run eagerly: communicators and
    workspaces exist)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    try:
        return _timed(graph.replay, iters, True)
    finally:
        torch.cuda.synchronize()
        graph.reset()


def _scattered(a: torch.Tensor, b: torch.Tensor, group, k: int) -> torch.Tensor:
    """megazoo's GEMM + reduce-scatter, its transfers waited for (stream-ordered)."""
    y_shard, in_flight = matmul_reduce_scatter(a, b, group, k)
    in_flight.wait()
    return y_shard


def _beside(a: torch.Tensor, b: torch.Tensor, group):
    """a @ b and an independent reduce-scatter of a tensor of its output's size on a side
    stream, both issued at once; returns the GEMM's result."""
    y = a @ b
    src = torch.randn_like(y)
    out = y.new_empty(y.shape[0] // dist.get_world_size(group), *y.shape[1:])
    side = torch.cuda.Stream() if a.device.type == "cuda" else None

    def run():
        if side is None:
            dist.reduce_scatter_tensor(out, src, group=group)
            return a @ b
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.reduce_scatter_tensor(out, src, group=group)
        y = a @ b
        torch.cuda.current_stream().wait_stream(side)
        return y
    return run


def probe(tokens: int, hidden: int, ffn: int, iters: int) -> list[dict]:
    """Every GEMM x variant on this rank: [{gemm, variant, us, rel_err}]."""
    group, t = dist.group.WORLD, dist.get_world_size()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator(device).manual_seed(dist.get_rank())
    shard = tokens // t

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) / shape[0] ** 0.5

    gemms = {  # name: (column?, A, B): column A is this rank's rows, row A the full rows
        "qkv": (True, rand(shard, hidden), rand(hidden, 3 * hidden // t)),
        "mlp_in": (True, rand(shard, hidden), rand(hidden, ffn // t)),
        "attn_out": (False, rand(tokens, hidden // t), rand(hidden // t, hidden)),
        "mlp_out": (False, rand(tokens, ffn // t), rand(ffn // t, hidden)),
    }
    rows = []
    for name, (column, a, b) in gemms.items():
        if column:
            full = torch.cat([a] * t)
            variants = {"gemm": lambda: full @ b,
                        "nccl": lambda: gather_matmul(a, b, group, 1)[1],
                        "overlap": lambda: gather_matmul(a, b, group, TP_COMM_CHUNKS)[1]}
        else:
            variants = {"gemm": lambda: a @ b,
                        "nccl": lambda: _scattered(a, b, group, 1),
                        "overlap": lambda: _scattered(a, b, group, TP_COMM_CHUNKS)}
        if not column:
            variants["beside"] = _beside(a, b, group)
        want, product = variants["nccl"]().float(), variants["gemm"]().float()
        for variant, fn in variants.items():
            row = {"gemm": name, "variant": variant, "us": None, "us_graph": None,
                   "rel_err": None, "error": None}
            try:
                got = fn().float()
                ref = product if variant == "beside" else want  # beside returns a @ b
                if variant != "gemm":
                    row["rel_err"] = float((got - ref).abs().max() / ref.abs().max())
                row["us"] = _timed(fn, iters, cuda)
                if cuda:
                    row["us_graph"] = _graphed(fn, iters)
            except Exception as exc:  # noqa: BLE001 - a variant torch lacks here is a row
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="micro-batch x sequence")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON of every row (rank 0)")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, 2 ranks, tiny shapes")
    cfg = p.parse_args(argv)
    if cfg.dry_run:
        from megazoo.testing import run_distributed

        rows = run_distributed(probe, 2, 64, 32, 64, 2, timeout=120)[0]
    else:
        os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        rows = probe(cfg.tokens, cfg.hidden, cfg.ffn, cfg.iters)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    for r in rows:
        shown = f"{r['us']:9.1f} µs" if r["us"] is not None else ""
        if r["us_graph"] is not None:
            shown += f"  graphed {r['us_graph']:9.1f} µs"
        if r["error"]:
            shown += f"  {r['error']}"
        err = "" if r["rel_err"] is None else f"  rel err {r['rel_err']:.1e}"
        print(f"{r['gemm']:9s} {r['variant']:13s} {shown}{err}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
