"""Two GPUs: a GPT split over pp = 2, plain 1F1B vs interleaved (vpp = 2), measured step times
against the simulator's prediction.

    torchrun --nproc-per-node 2 -m bench.pipeline_bench --out pipeline_bench.json

For each m in --microbatches: the measured median step time (forward + backward of the whole
pipeline, no optimizer) and the simulator's makespan from the forward/backward time of every
virtual stage (embedding and head included where they run) and the activation transfer time,
measured on the same GPUs just before. tf_ms / tb_ms in the table are their means.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import print_table, write_json

from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.pipeline import build_schedule, simulate
from megazoo.pipeline.executor import run_pipeline


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


def chunk_times(model, state, batch, seq, vocab, iters=5) -> list[tuple[float, float]]:
    """Per local chunk: mean forward and backward seconds on one micro-batch, measured as the
    pipeline runs it (the embedding on the first chunk of the first stage, the head and the
    loss on the last chunk of the last stage)."""
    shape = model.activation_shape(batch, seq)
    ids = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    out = []
    for c in range(len(model.chunks)):
        first = state.is_first_stage and c == 0
        last = state.is_last_stage and c == len(model.chunks) - 1
        fwd, bwd = [], []
        for i in range(iters + 2):
            x = None if first else torch.randn(shape, device=DEVICE, dtype=torch.bfloat16,
                                               requires_grad=True)
            _sync()
            t0 = time.perf_counter()
            y = model(ids if first else None, ids if last else None, hidden_states=x, chunk=c)
            _sync()
            t1 = time.perf_counter()
            y.backward(None if last else torch.randn_like(y))
            _sync()
            if i >= 2:
                fwd.append(t1 - t0)
                bwd.append(time.perf_counter() - t1)
        model.zero_grad(set_to_none=True)
        out.append((statistics.mean(fwd), statistics.mean(bwd)))
    return out


def stage_times(model, state, args) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per virtual stage (c * pp + r), from every rank."""
    local = torch.tensor(chunk_times(model, state, args.micro_batch, args.seq, args.vocab),
                         device=DEVICE, dtype=torch.float64)  # [vpp, 2]
    every = [torch.empty_like(local) for _ in range(state.pp.size)]
    dist.all_gather(every, local)
    vpp, pp = local.shape[0], state.pp.size
    per_stage = [every[s % pp][s // pp] for s in range(vpp * pp)]
    return [float(t[0]) for t in per_stage], [float(t[1]) for t in per_stage]


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
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
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
        tf, tb = stage_times(model, state, args)
        t_p2p = p2p_time(model.activation_shape(args.micro_batch, args.seq))
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
                             tf_ms=sum(tf) / len(tf) * 1e3, tb_ms=sum(tb) / len(tb) * 1e3,
                             p2p_ms=t_p2p * 1e3))
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
