"""The memory planner (megazoo.plan) against measured peak GPU memory, layout by layout.

    python -m bench.memory_bench --out memory_1gpu.json                       # 1 GPU layouts
    torchrun --nproc-per-node 2 -m bench.memory_bench --two-gpu --out memory_2gpu.json
    python -m bench.memory_bench --dry-run                                    # CPU, tiny
    torchrun --nproc-per-node 2 -m bench.memory_bench --two-gpu --dry-run     # CPU, gloo, tiny

Each layout runs real training steps of `pretrain_gpt.py`'s own engine (built by
`megazoo.training.backends.build_engine` from the run's `PretrainArgs`, `--bf16`): bf16
parameters, the contiguous fp32 main-gradient buffer, fp32 masters and AdamW moments, no
dropout, the model's default attention backend, one micro-batch per step (pp = 1) or m
micro-batches through the 1F1B executor (pp = 2). Step 1 allocates the Adam states; the peak
is then reset and taken over steps 2 and 3, on every rank, minus what was allocated before
the model was built. The table shows the most loaded rank.

Compared quantity: `MemoryEstimate.allocated` = parameters + gradients + optimizer states +
activations + communication buffers, i.e. the planner's `gpu_total` without its 10 %
fragmentation allowance (the allocator's cache, visible in memory_reserved, not in
max_memory_allocated) and without its 1 GiB for the CUDA context and library workspaces
(outside the caching allocator). error = predicted / measured - 1; target within 5 %.

--dry-run runs the same code on CPU with tiny models of the same families and layouts; it
measures nothing (CPU has no allocator statistics) and reports the prediction only.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import torch
import torch.distributed as dist

from bench.common import environment, print_table, write_json

from megazoo.config.run import DataConfig, PretrainArgs, TrainingConfig
from megazoo.models import ModelConfig, build_model
from megazoo.models.build import resolve_config
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.plan import GB, estimate_memory
from megazoo.training.backends import build_engine

LLAMA_1B4 = dict(family="llama", num_layers=24, hidden_size=2048, num_attention_heads=16,
                 ffn_hidden_size=5504, vocab_size=32000, max_position_embeddings=2048)
# name, model (preset or ModelConfig fields), micro-batch, recompute, tp, sp, pp, Megatron SP
ONE_GPU = [
    ("gpt-1.3b mb4 none", "gpt-1.3b", 4, "none", 1, 1, 1, False),
    ("gpt-1.3b mb4 selective", "gpt-1.3b", 4, "selective", 1, 1, 1, False),
    ("gpt-1.3b mb4 full", "gpt-1.3b", 4, "full", 1, 1, 1, False),
    ("gpt-1.3b mb8 full", "gpt-1.3b", 8, "full", 1, 1, 1, False),
    ("bloom-1b7 mb2 none", "bloom-1b7", 2, "none", 1, 1, 1, False),
    ("llama-1.4b mb2 none", LLAMA_1B4, 2, "none", 1, 1, 1, False),
]
TWO_GPU = [
    ("gpt-1.3b mb4 tp2 SP", "gpt-1.3b", 4, "none", 2, 1, 1, True),
    ("gpt-1.3b mb4 tp2", "gpt-1.3b", 4, "none", 2, 1, 1, False),
    ("gpt-1.3b mb4 sp2", "gpt-1.3b", 4, "none", 1, 2, 1, False),
    ("llama-1.4b mb2 tp2 SP", LLAMA_1B4, 2, "none", 2, 1, 1, True),
    ("gpt-1.3b mb2 pp2 m4", "gpt-1.3b", 2, "none", 1, 1, 2, False),
    ("gpt-1.3b mb2 pp2 m4 full", "gpt-1.3b", 2, "full", 1, 1, 2, False),
]
MICRO_BATCHES = 4  # per step under pp > 1
SEQ = 2048


def model_config(spec, dry_run: bool, pp: int) -> ModelConfig:
    """The layout's model; under --dry-run a tiny one of the same family."""
    config = resolve_config(spec) if isinstance(spec, str) else ModelConfig(**spec)
    if dry_run:
        extra = {"ffn_hidden_size": 96} if config.activation == "swiglu" else {}
        config = ModelConfig(family=config.family, num_layers=2 * pp, hidden_size=64,
                             num_attention_heads=8, vocab_size=300, max_position_embeddings=64, **extra)
    return config


def run_layout(row, args, device) -> dict:
    name, spec, mb, recompute, tp, sp, pp, seq_par = row
    seq = 64 if args.dry_run else SEQ
    config = dataclasses.replace(model_config(spec, args.dry_run, pp), recompute=recompute)
    parallel = ParallelConfig(tp=tp, sp=sp, pp=pp, sequence_parallel=seq_par)
    state = ParallelState.initialize(parallel)
    steps = MICRO_BATCHES if pp > 1 else 1
    run = PretrainArgs(  # the run these steps are: pretrain_gpt.py's engine, bf16, dp 1
        model=config, parallel=dataclasses.replace(parallel, dp=1), data=DataConfig(seq_length=seq),
        training=TrainingConfig(micro_batch_size=mb, global_batch_size=mb * steps, bf16=True))
    est = estimate_memory(run)
    _release(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = build_model(config, state, device=device, seed=0)
    engine = build_engine(run, model, state)
    g = torch.Generator().manual_seed(0)  # the same ids on every rank
    batches = [{"input_ids": ids.to(device), "labels": ids.to(device)} for ids in
               (torch.randint(0, config.vocab_size, (mb, seq), generator=g) for _ in range(steps))]
    for step in range(3):
        if step == 1 and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        engine.train_step(batches)
    measured = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        measured = (torch.cuda.max_memory_allocated(device) - before) / GB
    del model, engine, batches
    _release(device)
    return dict(layout=name, params=est.num_parameters, predicted_gb=est.allocated / GB,
                measured_gb=_per_rank(measured, device), parts_gb=_parts(est),
                plan_gpu_total_gb=est.gpu_total / GB)


def _parts(est) -> dict:
    return {k: getattr(est, k) / GB for k in ("parameters", "gradients", "optimizer_states",
                                              "activations", "communication_buffers")}


def _per_rank(measured, device) -> list | None:
    """Every rank's measured GB (None on CPU)."""
    if measured is None:
        return None
    if not dist.is_initialized():
        return [measured]
    t = torch.tensor([measured], dtype=torch.float64, device=device)
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return [x.item() for x in every]


def _release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarise(rows: list[dict]) -> list[dict]:
    table = []
    for r in rows:
        measured = max(r["measured_gb"]) if r["measured_gb"] else None
        error = None if measured is None else 100 * (r["predicted_gb"] / measured - 1)
        table.append(dict(layout=r["layout"], predicted_gb=r["predicted_gb"],
                          measured_gb=measured, error_pct=error,
                          activations_gb=r["parts_gb"]["activations"],
                          within_5pct=None if error is None else abs(error) <= 5))
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--two-gpu", action="store_true", help="the 2-rank layouts (under torchrun)")
    p.add_argument("--only", nargs="+", help="run only the layouts whose name contains one of these")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models: predictions only")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    args = p.parse_args(argv)
    if args.two_gpu and int(os.environ.get("WORLD_SIZE", "1")) != 2:
        print("launch with: torchrun --nproc-per-node 2 -m bench.memory_bench --two-gpu [...]")
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layouts = [r for r in (TWO_GPU if args.two_gpu else ONE_GPU)
               if not args.only or any(o in r[0] for o in args.only)]
    rows = [run_layout(r, args, device) for r in layouts]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_table(summarise(rows), ["layout", "predicted_gb", "measured_gb", "error_pct",
                                      "activations_gb", "within_5pct"])
        write_json(args.out, {"env": environment(device), "dry_run": args.dry_run,
                              "compared": "MemoryEstimate.allocated vs max_memory_allocated",
                              "rows": rows, "table": summarise(rows)})
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
