"""Cost of compressed gradient reduction (`megazoo.compress`) against NCCL all-reduce.

    python -m bench.compression_bench --out comp1.json                     # 1 GPU: kernels
    torchrun --nproc-per-node 2 -m bench.compression_bench --out comp2.json  # dp >= 2
    python -m bench.compression_bench --dry-run                            # CPU, gloo, tiny
    torchrun --nproc-per-node 2 -m bench.compression_bench --dry-run

The gradient is gpt-1.3b's (parameters counted on the meta device), fp32, cut into the plain
engine's buckets (`--bucket` elements, default Megatron's 40M), random normal values.

One process: each algorithm's whole reduction runs over a one-rank process group, so the
collectives are copies and what is timed is the compression and decompression work of a
step (topk: select, encode, residual, decode; 1bit / 2bit: encode, residual and decode of
both phases, with the chunk the whole bucket: the same element count a rank handles at any
dp; on a GPU through the Triton kernels, and as `*_eager` through the PyTorch codecs), set
against the time a bf16 ring all-reduce of the same gradient takes on an H200 pair at
`--link-gbs` GB/s per direction (default 450: NVLink 4, 18 links x 25 GB/s; a 2-GPU ring
moves the whole buffer once each way, so t = 2 (n - 1) / n x bytes / bandwidth).

dp >= 2 (torchrun): every algorithm's real reduction over the world against NCCL all-reduce
of the same buckets in fp32 and bf16, median of the slowest rank, and the bytes each sent.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from bench.common import environment, print_table, time_ms, write_json
from megazoo.compress import build_reduction
from megazoo.parallel.state import GroupInfo

# name -> (algorithm, wire dtype, codec implementation: None = automatic, Triton on GPUs)
ALGORITHMS = {"dense_fp32": (None, None, None), "dense_bf16": (None, torch.bfloat16, None),
              "topk_0.01": ("topk", None, None), "topk_0.01_eager": ("topk", None, "torch"),
              "1bit": ("1bit", None, None),
              "2bit": ("2bit", None, None), "1bit_eager": ("1bit", None, "torch"),
              "2bit_eager": ("2bit", None, "torch")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=None,
                   help="gradient elements (default: gpt-1.3b's parameter count)")
    p.add_argument("--bucket", type=int, default=40_000_000)
    p.add_argument("--block", type=int, default=1024, help="1bit / 2bit elements per scale")
    p.add_argument("--link-gbs", type=float, default=450.0,
                   help="GB/s per direction between the two GPUs (for the 1-GPU comparison)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU with gloo")
    p.add_argument("--out", help="write the rows as JSON here (rank 0)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.params, args.bucket, args.warmup, args.iters = 300_000, 100_000, 1, 2
    return args


def gpt_13b_params() -> int:
    from megazoo.models import build_model

    return sum(p.numel() for p in build_model("gpt-1.3b", device="meta").parameters())


def init(dry_run: bool) -> torch.device:
    """The process group (a one-rank in-memory one without a launcher) and the device."""
    use_gpu = torch.cuda.is_available() and not dry_run
    if not use_gpu and not dry_run:
        raise SystemExit("compression_bench needs a GPU; use --dry-run on CPU")
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if use_gpu else "gloo")
        else:
            dist.init_process_group("nccl" if use_gpu else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
    if not use_gpu:
        torch.set_num_threads(1)  # ranks share the host's cores
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device())


def make_buckets(numel: int, bucket: int, n: int, device) -> list[torch.Tensor]:
    """Random fp32 buckets of `bucket` elements (the last one smaller), each a multiple of n."""
    sizes = [bucket] * (numel // bucket) + ([numel % bucket] if numel % bucket else [])
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    return [torch.randn(-(-s // n) * n, device=device, generator=gen) for s in sizes]


def time_algorithm(name: str, buckets, group: GroupInfo, args, device) -> dict:
    """Median ms of one step's reduction of every bucket, and the bytes this rank sent."""
    algorithm, wire, impl = ALGORITHMS[name]
    red = build_reduction(algorithm, group, topk_ratio=0.01, block=args.block, wire_dtype=wire,
                          impl=impl)
    work = [b.clone() for b in buckets]

    def step():
        red.reset_bytes()
        pending = [red.launch(f"bucket{i}", w, None) for i, w in enumerate(work)]
        for p in pending:
            p.wait()

    ms = time_ms(step, device, args.warmup, args.iters)
    worst = torch.tensor([ms], device=device, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"algorithm": name, "ms": float(worst), "sent_mb": red.sent_bytes / 1e6,
            "ratio": red.dense_bytes / red.sent_bytes if red.sent_bytes else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init(args.dry_run)
    n, rank = dist.get_world_size(), dist.get_rank()
    group = GroupInfo(dist.group.WORLD if n > 1 else None, tuple(range(n)), rank)
    numel = int(args.params or gpt_13b_params())
    buckets = make_buckets(numel, args.bucket, n, device)
    names = list(ALGORITHMS) if n > 1 else [a for a in ALGORITHMS if a.startswith(("topk", "1", "2"))]
    rows = [time_algorithm(name, buckets, group, args, device) for name in names]
    ring = 2 * max(n - 1, 1) / max(n, 2) * numel * 2 / (args.link_gbs * 1e9) * 1e3
    for r in rows:
        if n == 1:  # compute alone, against the modelled bf16 all-reduce on an H200 pair
            r["bf16_allreduce_ms_model"] = ring
            r["pct_of_allreduce"] = 100.0 * r["ms"] / ring
    if rank == 0:
        print(f"{numel / 1e9:.3f}B gradient elements in {len(buckets)} buckets, dp {n}, "
              f"{environment(device)}")
        print_table(rows, list(rows[0]))
        write_json(args.out, {"env": environment(device), "numel": numel, "dp": n,
                              "link_gbs": args.link_gbs, "rows": rows})
    dist.barrier()
    if dist.get_backend() != "gloo":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
