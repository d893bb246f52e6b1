"""FSDP2Engine (ZeRO-3 under our pipeline schedules) on gloo against PlainEngine.

4 ranks, 4-layer GPT, 2 micro-batches per step, 3 steps, same seed and batches:
pp=2 x dp=2 (with and without CPU offload), pp=2 x Ulysses sp=2 (sharded over dp x sp),
pp=2 x tp=2 with Megatron SP (tp sums of SP gradients; dp x sp = 1, a one-rank mesh).

Tolerance: fp32 throughout; FSDP2 reduce-scatters flat shards where the plain engine
all-reduces whole gradients, and sums the norm in another order: rounding only. Losses agree
to rtol 1e-4 and grad norms to 1e-3 (measured differences ~1e-7); a wrong dp / sp factor,
a missing tied-embedding or tp sum moves them by far more.
"""
from __future__ import annotations

import pytest

import test_zero_ranks as ranks
from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed
from test_zero import assert_close_runs

LAYOUTS = [
    (ParallelConfig(pp=2), [{"name": "fsdp"}, {"name": "fsdp_offload", "cpu_offload": True}]),
    (ParallelConfig(pp=2, sp=2), [{"name": "fsdp"}]),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True), [{"name": "fsdp"}]),
]


def fsdp_layouts(layouts):
    return [ranks.fsdp_runs(par, runs) for par, runs in layouts]


def test_fsdp2_pipeline_matches_plain():
    results = run_distributed(fsdp_layouts, 4, LAYOUTS, timeout=300)
    for r in results:
        for (par, runs), layout in zip(LAYOUTS, r):
            assert_close_runs(layout, [run["name"] for run in runs], str(par))
