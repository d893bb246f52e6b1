"""Two GPUs: a GPT split over pp = 2, plain 1F1B vs interleaved (vpp = 2), measured step times
against the simulator's prediction.

    torchrun --nproc-per-node 2 bench/pipeline_bench.py --out pipeline_bench.json

For each m in --microbatches: the measured median step time (forward + backward of the whole
pipeline, no optimizer) and the simulator's makespan from the per-chunk forward/backward
times and the activation transfer time measured on the same GPUs just before.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json  # noqa: E402

from megazoo.models import ModelConfig, build_model  # noqa: E402
from megazoo.parallel import ParallelConfig, ParallelState  # noqa: E402
from megazoo.pipeline import build_schedule, simulate  # noqa: E402
from megazoo.pipeline.executor import activation_shape, run_pipeline  # noqa: E402


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn, iters: int) -> float:
    """Median wall seconds of fn() (synchronised, both ranks in step)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunk_times(model, state, batch, seq, iters=5) -> tuple[float, float]:
    """Mean forward and backward seconds of one chunk's blocks on one micro-batch (this rank).

    The embedding and the head are left out: the vocabulary is kept small (--vocab) so they
    are a few percent of a stage, and the simulator takes one time per chunk."""
    shape = activation_shape(model, batch, seq)
    fwd, bwd = [], []
    for c in range(len(model.chunks)):
        x = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        for i in range(iters + 2):
            _sync()
            t0 = time.perf_counter()
            y = x
            for layer in model.chunks[c]:  # the chunk's blocks (embedding/head not included)
                y = model.layers[str(layer)](y)
            _sync()
            t1 = time.perf_counter()
            y.backward(torch.randn_like(y))
            _sync()
            if i >= 2:
                fwd.append(t1 - t0)
                bwd.append(time.perf_counter() - t1)
    return statistics.mean(fwd), statistics.mean(bwd)


def p2p_time(shape, iters=10) -> float:
    buf = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    rank = dist.get_rank()

    def once():
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
    return _timed(once, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a gloo dry run of the code paths")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group()
    cfg = ModelConfig(family="gpt", num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.heads, vocab_size=args.vocab,
                      max_position_embeddings=args.seq)
    rows = []
    for vpp in (1, 2):
        state = ParallelState.initialize(ParallelConfig(pp=2, vpp=vpp))
        model = build_model(cfg, state, device=DEVICE, dtype=torch.bfloat16, seed=0)
        tf, tb = chunk_times(model, state, args.micro_batch, args.seq)
        times = torch.tensor([tf, tb], device=DEVICE)
        dist.all_reduce(times)
        tf, tb = (times / 2).tolist()  # mean over the two ranks
        t_p2p = p2p_time(activation_shape(model, args.micro_batch, args.seq))
        for m in args.microbatches:
            if vpp > 1 and m % 2:
                continue
            g = torch.Generator().manual_seed(m)
            batches = [(ids.to(DEVICE), ids.to(DEVICE)) for ids in
                       (torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g)
                        for _ in range(m))]

            def step():
                run_pipeline(model, batches, state)
                model.zero_grad(set_to_none=True)
            step()
            measured = _timed(step, args.iters)
            sim = simulate(build_schedule(2, vpp, m), tf, tb, t_p2p)
            rows.append(dict(schedule="1f1b" if vpp == 1 else "interleaved", vpp=vpp, m=m,
                             measured_s=measured, predicted_s=sim.makespan,
                             error=measured / sim.makespan - 1, bubble=sim.bubble_fraction,
                             tf_ms=tf * 1e3, tb_ms=tb * 1e3, p2p_ms=t_p2p * 1e3))
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print_table(rows, ["schedule", "m", "measured_s", "predicted_s", "error", "bubble",
                           "tf_ms", "tb_ms", "p2p_ms"])
        write_json(args.out, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
