"""Rank-side checks: whole models with context parallelism against one process.

The layouts of a 4-rank world that use cp: cp 4; Ulysses sp 2 inside cp 2 (the hybrid);
cp 2 with tp 2 and Megatron SP; cp 2 with dp 2; each for GPT (learned positions: a rank's
tokens are not contiguous), BLOOM (ALiBi of global positions in the ring), LLaMA (RoPE of
global positions, GQA) and LLaMA with one kv head; loss, full logits, and every gradient after
the dp x sp x cp reduction, through `model_checks._run_layout` (its tolerances: rtol 1e-4,
atol 1e-5, the same sums in another order). Full recompute is checked at cp 2 x sp 2.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megazoo.parallel import ParallelConfig, ParallelState
from .fixtures import tiny_config
from .model_checks import _run_layout, reference

LAYOUTS = [dict(cp=4), dict(cp=2, sp=2), dict(cp=2, tp=2, sequence_parallel=True), dict(cp=2)]


def check_cp_families(families=("gpt", "bloom", "llama", "llama-mqa")) -> list[str]:
    """Every family in every layout; returns the mismatches (empty when all agree)."""
    configs = {f: tiny_config(f) for f in families}
    refs = {f: reference(c) for f, c in configs.items()}
    errors = []
    for layout in LAYOUTS:
        state = ParallelState.initialize(ParallelConfig(**layout))
        for family, cfg in configs.items():
            tag = f"{family} {state.config}"
            errors += _run_layout(cfg, refs[family], state, tag)
            if layout == dict(cp=2, sp=2) and family in ("llama", "bloom"):
                errors += _run_layout(dataclasses.replace(cfg, recompute="full"), refs[family],
                                      state, tag + " recompute full")
                errors += _run_layout(cfg, refs[family], state, tag + " via logits", True)
    dist.barrier()
    return errors
