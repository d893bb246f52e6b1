"""DeepSpeedEngine on gloo: ZeRO-1/2/3 (with and without CPU optimizer offload), tp=2 with
Megatron SP, Ulysses sp=2, against PlainEngine with the same seed; save / resume; ZeRO ->
megazoo conversion. The config merging (`ds_config.py`) is tested without processes.

Tolerances. Everything is fp32. ZeRO reduces gradients by reduce-scatter / all-reduce of
flattened buckets instead of per-parameter all-reduces, DeepSpeedCPUAdam runs its own
vectorised C++ AdamW, and the norm is summed in another order: the same math in another
order, so results differ by float rounding only. Over 3 AdamW steps at lr 1e-2 those
differences stay below 1e-5 relative on the loss (measured ~1e-7); we allow rtol 1e-4 on the
losses and 1e-3 on the grad norms (a norm is a sum of squares of ~10^4 values, and clipping
makes step 2+ depend on it). A real bug (wrong scaling by dp or sp, a missing tp sum, a wrong
lr) moves the loss by > 1e-3 within 3 steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import zero_checks as ranks
from helpers.zero_checks import assert_close_runs
from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed

pytest.importorskip("deepspeed")

TIMEOUT = 300


DP_RUNS = [
    {"name": "zero1", "zero_stage": 1},
    {"name": "zero2", "zero_stage": 2},
    {"name": "zero3", "zero_stage": 3},
    {"name": "zero2_offload", "zero_stage": 2, "offload_optimizer": "cpu"},
    {"name": "zero3_offload", "zero_stage": 3, "offload_optimizer": "cpu",
     "offload_param": "cpu"},
    {"name": "zero1_offload_torch", "zero_stage": 1, "offload_optimizer": "cpu", "cpu_adam": False},
]


def test_zero_stages_match_plain_dp2(tmp_path):
    """dp=2: ZeRO-1/2/3, CPU offload with DeepSpeedCPUAdam and with torch AdamW, and a user
    JSON (ZeRO-2, tiny buckets so gradients cross bucket boundaries, "auto" batch size)."""
    user = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000,
                                  "allgather_bucket_size": 1000},
            "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0}
    (tmp_path / "ds.json").write_text(json.dumps(user))
    runs = DP_RUNS + [{"name": "json_zero2", "deepspeed_config": str(tmp_path / "ds.json")}]
    results = run_distributed(ranks.deepspeed_runs, 2, ParallelConfig(), runs, timeout=TIMEOUT)
    for r in results:
        assert_close_runs(r, [run["name"] for run in runs], "dp=2")
    assert results[0]["zero2_offload:cpu_adam"] is True
    assert results[0]["zero1_offload_torch:cpu_adam"] is False
    assert results[0]["plain"] == results[1]["plain"]  # the same value on every rank


TP_SP_LAYOUTS = [
    (ParallelConfig(tp=2, sequence_parallel=True),
     [{"name": "zero2", "zero_stage": 2}, {"name": "zero3_offload", "zero_stage": 3,
                                           "offload_optimizer": "cpu"}]),
    (ParallelConfig(sp=2),
     [{"name": "zero1_offload", "zero_stage": 1, "offload_optimizer": "cpu"},
      {"name": "zero3", "zero_stage": 3}]),
]


def test_zero_with_tp_and_ulysses_sp():
    """4 ranks: tp=2 + Megatron SP x dp=2, then Ulysses sp=2 x dp=2 (ZeRO over dp x sp)."""
    results = run_distributed(ranks.deepspeed_layouts, 4, TP_SP_LAYOUTS, timeout=TIMEOUT)
    for r in results:
        for (par, runs), layout in zip(TP_SP_LAYOUTS, r):
            assert_close_runs(layout, [run["name"] for run in runs], str(par))


TP2 = ParallelConfig(tp=2)
ZERO3_OFFLOAD = {"zero_stage": 3, "offload_optimizer": "cpu"}
ZERO1 = {"zero_stage": 1}


def _convert(load, out, *flags):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints_tools", "zero_to_megazoo.py")
    proc = subprocess.run([sys.executable, script, "--load", load, "--out", out, *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_save_resume_and_convert(tmp_path):
    """4 ranks: ZeRO-3 + CPU offload and ZeRO-1 at tp=2 x dp=2, ZeRO-2 at Ulysses sp=2 x dp=2,
    each saved at step 2; a fresh process group resumes the ZeRO-3 one and repeats steps 3-4
    (rtol 1e-5: the same computation from the same restored state); all three convert to
    megazoo checkpoints whose one-process loss equals the engine's eval loss at save time
    (rtol 1e-5: fp32 masters, the same math in one process)."""
    z3, z1, z2 = str(tmp_path / "z3"), str(tmp_path / "z1"), str(tmp_path / "z2sp")
    jobs = [(TP2, z3, ZERO3_OFFLOAD), (TP2, z1, ZERO1), (ParallelConfig(sp=2), z2, {"zero_stage": 2})]
    saved = run_distributed(ranks.deepspeed_save_many, 4, jobs, timeout=TIMEOUT)[0]
    with open(os.path.join(z3, "megazoo.json")) as f:
        meta = json.load(f)
    assert meta["format"] == "megazoo-deepspeed-1" and meta["extra"]["note"] == "test"
    resumed = run_distributed(ranks.deepspeed_resume, 4, TP2, z3, ZERO3_OFFLOAD,
                              timeout=TIMEOUT)[0]
    assert resumed["extra"]["iteration"] == 2 and resumed["steps"] == 4
    for (l0, n0), (l1, n1) in zip(saved[0]["after"], resumed["after"]):
        assert l1 == pytest.approx(l0, rel=1e-5) and n1 == pytest.approx(n0, rel=1e-5)
    for job, path in zip(saved, (z3, z1, z2)):
        _convert(path, path + "_mz")
        assert ranks.one_process_probe(path + "_mz", 2) == pytest.approx(job["probe"], rel=1e-5)


def test_convert_rejects_plain_folder(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..",
                           "checkpoints_tools", "zero_to_megazoo.py"), "--load", str(tmp_path),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "megazoo.json is missing" in proc.stderr


def test_bf16_zero3_sums_micro_batches_in_fp32():
    """bf16, dp 2, 4 micro-batches per step: ZeRO-3 accumulates their gradients in fp32 (the
    config megazoo builds reaches DeepSpeed) and follows the plain engine. Tolerance 1e-2 on
    the loss and gradient norm: both run bf16 weights and activations, whose products round
    to 8 bits of mantissa (0.4%) and reach the norm through different reduction orders."""
    result = run_distributed(ranks.bf16_zero3_accumulation, 2, timeout=TIMEOUT)[0]
    assert result["accumulation_dtype"] == "torch.float32"
    for (loss, norm), (ref_loss, ref_norm) in zip(result["zero3"], result["plain"]):
        assert loss == pytest.approx(ref_loss, rel=1e-2)
        assert norm == pytest.approx(ref_norm, rel=1e-2)
