"""How long the host takes to issue a micro-batch, per layout: the planner's host constants.

    python -m bench.host_pace                          # CPU, fp32
    python -m bench.host_pace --device cuda --out $OUT/host_pace.json   # the GPU's host, bf16

At micro-batch 4 the host, not the GPU, sets tp's and Ulysses' pace
(bench/results/tp_host_bound_h200_2026-11-28.md). This measures that pace alone. One
process plays rank 0 of each layout on torch's fake process group, whose collectives move
nothing and return at once. The model is built at the real width, but the sequence is so
short (`--seq`) that the GPU's work is negligible. So the wall time of a forward + backward
is the host's time to issue it, and no other rank's skew enters.

From the rows it fits the planner's `Cluster.host_block_ms` (tp 1: the time per block),
`host_collective_ms` (tp 2 + SP: the time per collective call, the calls per block being
`plan.collectives.layer_collectives`), `host_fsdp2_unit_ms` (the FSDP2 row, ZeRO-3 at dp 4
as `--zero-impl fsdp2` shards it, `--fsdp-blocks-per-unit` blocks per unit, a micro-batch that
does not sync gradients: what FSDP2's hooks add per unit) and `host_deepspeed_block_ms` (the
DeepSpeed row, `--deepspeed --zero-stage 3` with megazoo's tuned config over the same dp 4:
what its hooks add per block, its per-micro-batch gradient partitioning included). NCCL's
own enqueue is not in the fake group's calls, so the per-call figure is a lower bound on a
real group's.

Reported per layout: ms per micro-batch (the best of `--repeats` rounds of `--steps`), the
part of it spent issuing the forward, and µs per block.

`--kernels` times the other side: the GPU's kernels per micro-batch (torch.profiler's device
time over `--steps` micro-batches), at the run's shape (`--seq 2048 --micro 4` for gpt-1.3b).
On the fake group that is a layout's compute with no communication at all, to set against
N x one GPU and against the planner's compute.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from megazoo.config.zero import ZeroConfig

LAYOUTS = {  # name -> (tp, Megatron SP, Ulysses size, the ZeRO-3 engine sharding over dp 4)
    "tp1": (1, False, 1, None), "tp2+SP": (2, True, 1, None), "tp2": (2, False, 1, None),
    "ulysses sp2": (1, False, 2, None), "fsdp2 dp4": (1, False, 1, "fsdp2"),
    "deepspeed dp4": (1, False, 1, "deepspeed"),
}
ZERO_DP = 4


def _model(args, tp: int, megatron_sp: bool, sp: int, zero: str | None):
    """(config, the step's forward, its backward) of one layout on a fresh fake group."""
    from megazoo.config.model import ModelConfig
    from megazoo.models.build import build_model
    from megazoo.parallel.config import ParallelConfig
    from megazoo.parallel.state import ParallelState

    config = ModelConfig(family=args.family, num_layers=args.layers, hidden_size=args.hidden,
                         num_attention_heads=args.heads, vocab_size=2048,
                         max_position_embeddings=max(args.seq, 64))
    if dist.is_initialized():
        dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dp = ZERO_DP if zero else 1
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * sp * dp)
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=megatron_sp, sp=sp,
                                                    dp=dp), backend="fake")
    bf16 = args.device == "cuda"
    if zero is None:
        dtype = torch.bfloat16 if bf16 else torch.float32
        return config, build_model(config, state, device=args.device, dtype=dtype), _backward
    model = build_model(config, state, device=args.device, dtype=torch.float32)  # fp32 masters
    if zero == "deepspeed":
        return config, *_deepspeed(args, config, model, state)
    from megazoo.training.backends.fsdp2_sharding import shard_mesh, shard_stage

    device = torch.device(args.device)
    shard_stage(model, shard_mesh(state, device), device=device, bf16=bf16, cpu_offload=False,
                reshard_after_forward=True, blocks_per_unit=args.fsdp_blocks_per_unit)
    model.set_requires_gradient_sync(False)  # a micro-batch before the step's last
    return config, model, _backward


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _deepspeed(args, config, model, state):
    """DeepSpeed ZeRO-3 over the fake dp group, as `--deepspeed --zero-stage 3` builds it (its
    tuned config): (its module, its backward). Each of its micro-batches reduce-scatters the
    gradients (it has no step without), so its row includes that."""
    import dataclasses

    from megazoo.config.flags import parse_args as pretrain_args
    from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine

    flags = (f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads "
             f"{args.heads} --seq-length {args.seq} --max-position-embeddings "
             f"{max(args.seq, 64)} --micro-batch-size {args.micro} --global-batch-size "
             f"{2 * args.micro * ZERO_DP} --deepspeed --zero-stage 3").split()
    run = pretrain_args(flags + (["--bf16"] if args.device == "cuda" else []), check_data=False)
    run = dataclasses.replace(run, model=config, parallel=state.config)
    engine = DeepSpeedEngine(model, state, run)
    return engine.ds, engine.ds.backward


@contextlib.contextmanager
def launcher_variables():
    """The launcher's rank variables, which DeepSpeed reads while it builds and runs, set for
    the fake rank 0 of dp 4 and restored after (a process started later must not see them)."""
    launcher = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": str(ZERO_DP)}
    before = {k: os.environ.get(k) for k in launcher}
    os.environ.update(launcher)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pace(args, name: str) -> dict:
    """ms per micro-batch of one layout (module docstring)."""
    if LAYOUTS[name][3] == "deepspeed":
        with launcher_variables():
            return _pace(args, name)
    return _pace(args, name)


def _pace(args, name: str) -> dict:
    config, model, backward = _model(args, *LAYOUTS[name])
    ids = torch.randint(0, config.vocab_size, (args.micro, args.seq), device=args.device)

    def step() -> float:
        """One micro-batch; returns the seconds the forward took to issue."""
        start = time.perf_counter()
        loss = model(ids, ids)
        forward = time.perf_counter() - start
        backward(loss)
        return forward

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    if args.kernels:
        return {"layout": name, "kernel_ms": _kernel_ms(args, step), "layers": args.layers}
    best, forward = float("inf"), 0.0
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        issued = sum(step() for _ in range(args.steps))
        sync()
        took = (time.perf_counter() - start) / args.steps
        if took < best:
            best, forward = took, issued / args.steps
    return {"layout": name, "ms_per_micro_batch": best * 1e3, "forward_ms": forward * 1e3,
            "us_per_block": best * 1e6 / args.layers, "layers": args.layers}


def _kernel_ms(args, step) -> float:
    """ms per micro-batch of the GPU's kernels over `--steps` micro-batches (torch.profiler,
    `profile_train.busy_us`); on CPU the operators' own time, a stand-in that checks the
    path."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_train import busy_us

    cuda = args.device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    return busy_us(prof.key_averages(), cuda) / 1e3 / args.steps


def fit(rows: dict, args) -> dict:
    """host_block_ms from tp1; host_collective_ms from tp2 + SP's extra time per call;
    host_fsdp2_unit_ms from the FSDP2 row's extra time per unit (`--fsdp-blocks-per-unit`
    blocks each); host_deepspeed_block_ms from DeepSpeed ZeRO-3's extra time per block;
    host_forward_share: the forwards' share of all rows' time (`plan.work.HOST_FORWARD_SHARE`)."""
    from megazoo.config.model import ModelConfig
    from megazoo.plan.collectives import layer_collectives

    out = {}
    if "tp1" in rows:
        out["host_block_ms"] = rows["tp1"]["ms_per_micro_batch"] / args.layers
    if "tp1" in rows and "tp2+SP" in rows:
        config = ModelConfig(family=args.family, num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads)
        calls = sum(c.calls for c in layer_collectives(config, tp=2, sp=1, megatron_sp=True,
                                                       micro_batch=args.micro,
                                                       seq_length=args.seq))
        extra = rows["tp2+SP"]["ms_per_micro_batch"] - rows["tp1"]["ms_per_micro_batch"]
        out["host_collective_ms"] = max(extra, 0.0) / (args.layers * calls)
    if "tp1" in rows and "fsdp2 dp4" in rows:
        extra = rows["fsdp2 dp4"]["ms_per_micro_batch"] - rows["tp1"]["ms_per_micro_batch"]
        units = -(-args.layers // args.fsdp_blocks_per_unit)
        out["host_fsdp2_unit_ms"] = max(extra, 0.0) / units
    if "tp1" in rows and "deepspeed dp4" in rows:
        extra = rows["deepspeed dp4"]["ms_per_micro_batch"] - rows["tp1"]["ms_per_micro_batch"]
        out["host_deepspeed_block_ms"] = max(extra, 0.0) / args.layers
    timed = [r for r in rows.values() if "forward_ms" in r]
    if timed:  # the planner's HOST_FORWARD_SHARE: of the host's time, the forward's share
        out["host_forward_share"] = (sum(r["forward_ms"] for r in timed)
                                     / sum(r["ms_per_micro_batch"] for r in timed))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--family", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=None, help="default: 2048 on cuda, 64 on cpu")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (short: host-bound)")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--fsdp-blocks-per-unit", type=int, default=ZeroConfig.fsdp_blocks_per_unit,
                   help="blocks per FSDP2 unit in the FSDP2 row (pretrain_gpt.py's flag and "
                        "default)")
    p.add_argument("--kernels", action="store_true",
                   help="time the GPU's kernels per micro-batch instead of the host (give the "
                        "run's --seq and --micro): a layout's compute without communication")
    p.add_argument("--out", default=None, help="write the rows and the fit as JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here")
    args.hidden = args.hidden or (2048 if args.device == "cuda" else 64)
    for name in args.layouts:
        tp, _, sp, _ = LAYOUTS[name]
        if args.seq % (tp * sp) or args.heads % (tp * sp):
            p.error(f"--seq {args.seq} and --heads {args.heads} must divide by {tp * sp} ({name})")
    return args


def main(argv=None) -> int:
    from bench.common import print_table, write_json

    args = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the host's one issuing thread; tiny tensors need no more
    rows = {name: pace(args, name) for name in args.layouts}
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.kernels:
        constants = {}
        print_table(list(rows.values()), ["layout", "kernel_ms"])
    else:
        constants = fit(rows, args)
        print_table(list(rows.values()), ["layout", "ms_per_micro_batch", "forward_ms",
                                          "us_per_block"])
        print("fit: " + ", ".join(f"{k} {v:.3f}" for k, v in constants.items()))
    write_json(args.out, {"device": args.device, "rows": rows, "fit": constants,
                          "flags": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
