"""Rank-side code of `test_offload_overlap.py` (no tests here): the offloaded optimizer's
runs with and without --overlap-cpu-optimizer-d2h-h2d, repeated, on the tiny GPT of
`ddp_checks`.

A run trains with the model's id check off, as pretrain_gpt.py does (the embedding then
looks ids up without its module call), and returns everything the step writes: the losses,
the fp32 masters and moments, and the model's parameters. `slow` delays every host step on
the worker thread, so a read that does not wait for its bucket's new values sees the old
ones every time instead of now and then.
"""
from __future__ import annotations

import time

import torch

from megazoo.config.zero import ZeroConfig
from megazoo.parallel import ParallelConfig
from megazoo.offload import host_split

from . import ddp_checks as checks

STEPS = 4
REPEATS = 20
SMALL = {"ddp_bucket_size": 3000}  # several buckets in the tiny model


def flags(overlap: bool, fraction: float = 1.0, **extra) -> dict:
    return {**SMALL, "optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "overlap_cpu_optimizer_d2h_h2d": overlap, **extra}


def split_budget(**extra) -> float:
    """--optimizer-offload-host-memory (GB) that keeps the first host bucket of the forward
    in memory and puts the rest on disk (`host_split`, the engine's rule)."""
    engine, _ = checks.engine_for(ParallelConfig(), **flags(True, **extra))
    sizes = [s.numel for s in engine.optimizer.host_order]
    for budget in range(256, 10**7, 256):
        split = host_split(sizes, budget, grad_bytes=4, param_bytes=4,
                           late_grads=not extra.get("offload_delayed_update", False))
        if split.host <= budget and split.memory >= 1:
            assert split.memory < len(sizes)
            return budget / 1e9
    raise AssertionError("no budget splits the host buckets")


def run(overlap: bool, *, slow: float = 0.0, nvme: str | None = None, **extra) -> dict:
    """STEPS steps; the losses and every tensor the optimizer step writes."""
    zero = ZeroConfig(nvme_path=nvme) if nvme else None
    engine, state = checks.engine_for(ParallelConfig(), zero=zero, **flags(overlap, **extra))
    engine.model.check_inputs = False
    opt = engine.optimizer
    if slow:
        host_step = opt._host_step

        def slowed(*args):
            time.sleep(slow)
            host_step(*args)
        opt._host_step = slowed  # (the worker looks it up on the instance)
    losses = checks.train(engine, state, range(STEPS))
    out = opt.full_state()  # (waits for the last step's parameters)
    out["params"] = engine.buffers.param_data.clone()
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    return out


def mismatches(runs: list[dict], ref: dict) -> list[str]:
    """'run k: name' for every tensor of every run that is not bit-equal to `ref`'s."""
    return [f"run {k}: {name}" for k, out in enumerate(runs) for name, want in ref.items()
            if not torch.equal(out[name], want)]


def repeated(ref_flags: dict | None, nvme: str | None = None, **extra) -> list[str]:
    """The overlapped run, slowed once and then REPEATS times as it comes, against the run
    without the overlap (`ref_flags` None: against the first overlapped run; the delayed
    update has no un-overlapped twin). Disk runs get a folder each."""
    def folder(tag):
        return None if nvme is None else f"{nvme}/{tag}"

    ref = run(False, nvme=folder("ref"), **extra) if ref_flags is not None else None
    runs = [run(True, slow=0.02, nvme=folder("slow"), **extra)]
    runs += [run(True, nvme=folder(k), **extra) for k in range(REPEATS)]
    return mismatches(runs, ref if ref is not None else runs[0])
