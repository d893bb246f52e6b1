"""Training with context parallelism on the plain engine (fp32 main-gradient buckets with
overlapped reduction, the distributed optimizer, pipeline stages, checkpoint save) against the
one-process run, on 4 gloo ranks: 3 AdamW steps of a 4-layer GPT at 16 tokens (learned
positions), then the saved checkpoint loaded as the one-process model.

Tolerances as test_data_parallel.py (rtol 1e-5, atol 1e-5: the same float32 sums in another
order; a gradient missing the cp sum, or counted twice, is off by a factor of 2 and moves
the loss in the third digit after one step).
"""
import pytest
import torch

from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed

from helpers import ddp_checks as checks
from helpers import zero_checks
from helpers.zero_checks import assert_close_runs

FLAGS = {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
         "ddp_bucket_size": 3000}
LAYOUTS = [  # name, layout (4 ranks), training flags
    ("cp2_dp2", ParallelConfig(cp=2), FLAGS),
    ("sp2_cp2", ParallelConfig(sp=2, cp=2), FLAGS),
    ("cp2_pp2", ParallelConfig(cp=2, pp=2), {}),
    ("tp2_cp2", ParallelConfig(tp=2, cp=2, sequence_parallel=True), FLAGS),
]


def test_context_parallel_training_matches_one_process(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (see test_data_parallel.py's reference)
    try:
        ref = checks.run_and_save(ParallelConfig(), str(tmp_path / "ref"))
    finally:
        torch.set_num_threads(threads)
    jobs = [(par, str(tmp_path / name), flags) for name, par, flags in LAYOUTS]
    results = run_distributed(checks.layouts, 4, jobs, timeout=300)
    for (name, _, _), out in zip(LAYOUTS, results[0]):
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        for key, want in ref["params"].items():
            torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=key: f"{name}: {k}: {m}")


ZERO_LAYOUTS = [  # (layout, DeepSpeed runs) on 4 ranks: ZeRO over dp x cp
    (ParallelConfig(cp=2), [{"name": "zero1", "zero_stage": 1}, {"name": "zero3", "zero_stage": 3}]),
    (ParallelConfig(sp=2, cp=2), [{"name": "zero2", "zero_stage": 2}]),
]
FSDP_LAYOUTS = [(ParallelConfig(cp=2), [{"name": "fsdp"}]),
                (ParallelConfig(pp=2, cp=2), [{"name": "fsdp"}])]


def _zero_engines(zero_layouts, fsdp_layouts):
    return (zero_checks.deepspeed_layouts(zero_layouts),
            [zero_checks.fsdp_runs(par, runs) for par, runs in fsdp_layouts])


def test_zero_and_fsdp2_with_context_parallel_match_the_plain_engine():
    """DeepSpeed ZeRO-1/2/3 and FSDP2 (ZeRO-3 under the pipeline schedule) shard over
    dp x sp x cp; each run's per-step loss and gradient norm match the plain engine on the
    same layout (which matches one process above): rtol 1e-4 / 1e-3, zero_checks' tolerances
    (flat shards reduced in another order). A missing cp factor (ZeRO-3 and FSDP2 average over
    the group) doubles the gradient norm."""
    results = run_distributed(_zero_engines, 4, ZERO_LAYOUTS, FSDP_LAYOUTS, timeout=400)
    for zero, fsdp in results:
        for (par, runs), layout in zip(ZERO_LAYOUTS + FSDP_LAYOUTS, zero + fsdp):
            assert_close_runs(layout, [run["name"] for run in runs], str(par))
