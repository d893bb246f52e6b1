"""Ulysses attention on 2 GPUs against DeepSpeed-Ulysses' DistributedAttention, same run.

    torchrun --nproc-per-node 2 -m bench.ulysses_bench --out ulysses.json
    torchrun --nproc-per-node 2 -m bench.ulysses_bench --chunks 2 8 --out ulysses.json  # k=2, 8 too
    torchrun --nproc-per-node 2 -m bench.ulysses_bench --dry-run        # CPU, gloo, tiny
    torchrun --nproc-per-node 2 -m bench.ulysses_bench --sparse bigbird bslongformer \
        --seqs 65536 131072 --out ulysses_sparse.json      # the block-sparse layer instead

Three implementations in one run: "ours" = UlyssesOverlapAttention (experimental/ulysses_overlap.py: the
rank's heads in k chunks, each chunk's all-to-alls overlapping another chunk's attention in
forward and backward; k automatic, 4 at 32 heads on 2 ranks), "plain" = UlyssesAttention (one
all-to-all for q, k, v, then attention, then one all-to-all: nothing overlapped), and DeepSpeed.
`--chunks K ...` (default 2) adds an overlapped column per K: k{K}_ms, eff_k{K}.

32 heads x 128, batch 1, bf16, causal SDPA as the local attention on both sides; forward +
backward at 32k, 64k and 128k tokens. Efficiency = t(1 GPU, full sequence) / (2 x t(2 GPUs)),
where t(1 GPU) is SDPA alone on the full sequence (each rank measures it on its own GPU) and
t(2 GPUs) the slower rank's median.

Each side gets the input its projection produces: ours the fused QKV activation
[s/2, b, 32 x 3 x 128] (per head [q, k, v], one all-to-all for all three), DeepSpeed three
tensors q, k, v [s/2, b, 32, 128] (three all-to-alls). Before timing, both outputs are checked
against each other on the same numbers.

`--sparse MODE ...` times the block-sparse layer instead (UlyssesAttention(sparse=...), the
layouts of `bench/sparse_attention_bench.py` at --sparse-block with a causal window of about
--window tokens): per mode, dense and sparse Ulysses on all ranks, the same two modules on
one GPU over the full sequence (sp group of one rank), sparse time vs dense (x_dense) and the
efficiency t(1 GPU) / (ranks x t(ranks)) of each. The ranks' outputs are checked against the
one-GPU output of the same numbers (max_diff).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common import environment, print_table, time_ms, write_json
from megazoo.layers import UlyssesAttention
from bench.experimental.ulysses_overlap import UlyssesOverlapAttention
from bench.sparse_setup import allow_recompiles, sparse_configs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="sdpa", help="our local attention backend (auto, sdpa, ...)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--chunks", type=int, nargs="*", default=[2],
                   help="also time the overlapped version with these chunk counts (none: --chunks)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    p.add_argument("--sparse", nargs="+", metavar="MODE",
                   help="time the block-sparse layer in these modes (bigbird, bslongformer, fixed)")
    p.add_argument("--sparse-block", type=int, default=128)
    p.add_argument("--window", type=int, default=256, help="--sparse: causal window in tokens")
    p.add_argument("--dry-run", action="store_true", help="tiny float32 run on CPU with gloo")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.seqs, args.heads, args.head_dim, args.warmup, args.iters = [64, 128], 8, 16, 1, 2
        if args.sparse:  # a few blocks of --sparse-block: the layouts need a window's worth
            args.seqs = [8 * args.sparse_block]
    return args


def sdpa_causal_sbhd(q, k, v):
    """The local attention both sides run: [s, b, h, d] in and out, causal SDPA."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3)


def deepspeed_attention(group):
    """DeepSpeed's DistributedAttention around sdpa_causal_sbhd, or None when not installed."""
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError as e:
        print(f"deepspeed unavailable ({e}): skipping its rows")
        return None
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # reuses the initialised group
    # scatter_idx=2 (heads), gather_idx=0 (sequence): inputs [s/p, b, h, d], batch_dim_idx=1.
    return DistributedAttention(sdpa_causal_sbhd, group, scatter_idx=2, gather_idx=0)


def implementations(args) -> dict:
    """name -> our Ulysses module: the overlapped default, the plain one, extra chunk counts."""
    common = dict(sp_group=dist.group.WORLD, attention_backend=args.backend)
    mods = {"ours": UlyssesOverlapAttention(args.heads, args.head_dim, **common),
            "plain": UlyssesAttention(args.heads, args.head_dim, **common)}
    for k in args.chunks:
        try:
            mods[f"k{k}"] = UlyssesOverlapAttention(args.heads, args.head_dim, num_chunks=k, **common)
        except ValueError as e:  # k must divide the heads per rank: say so, run the others
            if dist.get_rank() == 0:
                print(f"skipping --chunks {k}: {e}")
    return mods


def bench_seq(s, args, device, dtype, ds_attn) -> dict:
    world, h, d, b = dist.get_world_size(), args.heads, args.head_dim, args.batch
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    qkv = torch.randn(s // world, b, h * 3 * d, device=device, dtype=dtype, generator=g)
    grad = torch.randn(s // world, b, h * d, device=device, dtype=dtype, generator=g)
    mods = implementations(args)
    qkv.requires_grad_()
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.view(s // world, b, h, 3, d).unbind(3))

    def step(module):
        return lambda: torch.autograd.grad(module(qkv), qkv, grad)

    def step_ds():
        torch.autograd.grad(ds_attn(q, k, v, 1), (q, k, v), grad.view(s // world, b, h, d))

    row = {"seq": s, "chunks": mods["ours"].num_chunks}
    with torch.no_grad():
        y = mods["plain"](qkv)
        row["max_diff_vs_plain"] = (mods["ours"](qkv).float() - y.float()).abs().max().item()
        if ds_attn is not None:
            row["max_diff_vs_ds"] = (y.float() - ds_attn(q, k, v, 1).flatten(2).float()).abs().max().item()
        del y
    for name, module in mods.items():
        dist.barrier()
        row[f"{name}_ms"] = _slowest(time_ms(step(module), device, args.warmup, args.iters))
    if ds_attn is not None:
        dist.barrier()
        row["ds_ms"] = _slowest(time_ms(step_ds, device, args.warmup, args.iters))
    del qkv, q, k, v, grad
    row["one_gpu_ms"] = _slowest(_one_gpu(s, args, device, dtype))
    for name in list(mods) + (["ds"] if "ds_ms" in row else []):
        row[f"eff_{name}"] = row["one_gpu_ms"] / (world * row[f"{name}_ms"])
    row["speedup_vs_plain"] = row["plain_ms"] / row["ours_ms"]
    if "ds_ms" in row:
        row["speedup_vs_ds"] = row["ds_ms"] / row["ours_ms"]
    return row


def sparse_rows(s, args, device, dtype) -> list[dict]:
    """Dense and block-sparse UlyssesAttention over all ranks and on this rank alone, per mode."""
    world, rank, h, d, b = dist.get_world_size(), dist.get_rank(), args.heads, args.head_dim, args.batch
    g = torch.Generator(device=device).manual_seed(0)  # the same full inputs on every rank
    full = torch.randn(s, b, h * 3 * d, device=device, dtype=dtype, generator=g).requires_grad_()
    full_grad = torch.randn(s, b, h * d, device=device, dtype=dtype, generator=g)
    chunk = slice(rank * s // world, (rank + 1) * s // world)
    shard = full.detach()[chunk].clone().requires_grad_()
    grad = full_grad[chunk]

    def timed(module, x, dy) -> float:
        dist.barrier()
        return _slowest(time_ms(lambda: torch.autograd.grad(module(x), x, dy), device,
                                args.warmup, args.iters))

    def pair(sparse):
        common = dict(attention_backend=args.backend, sparse=sparse)
        return (UlyssesAttention(h, d, sp_group=dist.group.WORLD, **common),
                UlyssesAttention(h, d, sp_group=None, **common))

    dense, dense_one = pair(None)
    base = {"seq": s, "dense_ms": timed(dense, shard, grad), "one_dense_ms": timed(dense_one, full, full_grad)}
    base["eff_dense"] = base["one_dense_ms"] / (world * base["dense_ms"])
    rows = []
    for label, cfg in sparse_configs(args.sparse, [args.sparse_block], args.window):
        many, one = pair(cfg)
        with torch.no_grad():
            diff = (many(shard).float() - one(full)[chunk].float()).abs().max()
        row = {**base, "mode": label, "block": cfg.block, "max_diff": _slowest(diff.item()),
               "sparse_ms": timed(many, shard, grad), "one_sparse_ms": timed(one, full, full_grad)}
        row["x_dense"] = row["dense_ms"] / row["sparse_ms"]
        row["x_dense_one"] = row["one_dense_ms"] / row["one_sparse_ms"]
        row["eff_sparse"] = row["one_sparse_ms"] / (world * row["sparse_ms"])
        rows.append(row)
    return rows


SPARSE_COLUMNS = ["seq", "mode", "block", "dense_ms", "sparse_ms", "x_dense", "one_dense_ms",
                  "one_sparse_ms", "x_dense_one", "eff_dense", "eff_sparse", "max_diff"]


def _one_gpu(s, args, device, dtype) -> float:
    """SDPA causal fwd+bwd over the full sequence on this rank's device alone."""
    q, k, v = (torch.randn(args.batch, args.heads, s, args.head_dim, device=device, dtype=dtype)
               .requires_grad_() for _ in range(3))
    grad = torch.randn_like(q)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    return time_ms(step, device, args.warmup, args.iters)


def _slowest(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("launch with: torchrun --nproc-per-node 2 -m bench.ulysses_bench [...]")
        return 2
    backend = "gloo" if args.dry_run else "nccl"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", int(os.environ["LOCAL_RANK"])), torch.bfloat16
        torch.cuda.set_device(device)
    if args.sparse:
        allow_recompiles()  # FlexAttention: one compile per length, head count and grad mode
        rows = [r for s in args.seqs for r in sparse_rows(s, args, device, dtype)]
        if rank == 0:
            print_table(rows, SPARSE_COLUMNS)
            write_json(args.out, {"env": environment(device), "world": dist.get_world_size(),
                                  "args": vars(args), "rows": rows})
        dist.barrier()
        dist.destroy_process_group()
        return 0
    ds_attn = None if args.no_deepspeed else deepspeed_attention(dist.group.WORLD)
    rows = [bench_seq(s, args, device, dtype, ds_attn) for s in args.seqs]
    if rank == 0:
        extra = [c for k in args.chunks for c in (f"k{k}_ms", f"eff_k{k}") if c in rows[0]]
        print_table(rows, ["seq", "chunks", "one_gpu_ms", "ours_ms", "plain_ms", "ds_ms"] + extra
                    + ["eff_ours", "eff_plain", "eff_ds", "speedup_vs_plain", "speedup_vs_ds",
                       "max_diff_vs_plain", "max_diff_vs_ds"])
        write_json(args.out, {"env": environment(device), "world": dist.get_world_size(),
                              "args": vars(args), "rows": rows})
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    if args.dry_run and ds_attn is not None:
        # On CPU, DeepSpeed's comm backend after our asynchronous gloo all-to-alls sometimes
        # aborts at interpreter exit ("terminate called without an active exception"), after
        # all results are out (GPU runs: not known yet). Leave without the C++ teardown.
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
