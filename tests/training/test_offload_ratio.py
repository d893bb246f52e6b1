"""ZeRO-3 partial optimizer offload (`--offload-optimizer-ratio`): config and planner."""
from __future__ import annotations

import json

import pytest

from megazoo.config.ds_config import build_ds_config
from megazoo.models import resolve_config
from megazoo.plan import estimate_memory

from helpers.run_args import ds_args as args
from helpers.run_args import plan_args


def test_ratio_reaches_deepspeed_and_conflicts_are_named(tmp_path):
    ds = build_ds_config(args(zero_stage=3, offload_optimizer="cpu", offload_optimizer_ratio=0.7), dp=1)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "ratio": 0.7}
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5}}}))
    with pytest.raises(ValueError, match="0.7.*0.5|0.5.*0.7"):
        build_ds_config(args(deepspeed_config=str(user), offload_optimizer_ratio=0.7), dp=1)
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        build_ds_config(args(zero_stage=2, offload_optimizer="cpu", offload_optimizer_ratio=0.7), dp=1)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        args(offload_optimizer_ratio=1.5)


def test_planner_moves_the_kept_fraction_to_the_gpu():
    """16 B per parameter (fp32 master, m, v, fp32 grads) split host:GPU as ratio:(1-ratio)."""
    cfg = resolve_config("gpt-1.3b")
    full, part = (estimate_memory(plan_args(cfg, zero_stage=3, offload_optimizer="cpu",
                                            offload_optimizer_ratio=None if r == 1 else r))
                  for r in (1.0, 0.75))
    n = full.parameters_per_gpu
    assert full.host_per_gpu - part.host_per_gpu == pytest.approx(0.25 * 16 * n)
    # + DeepSpeed ZeRO-3's host buffers: bf16 gradient partitions, the largest sub-group's fp32
    # gradient buffer (sub-groups of at most 1e9 elements) and the process runtime (plan.py).
    assert full.host_per_gpu == pytest.approx(16 * n + 2 * n + 4 * min(n, 1e9) + 3.2e9)
    assert part.optimizer_states == pytest.approx(0.25 * 16 * n)
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):  # the run's own check
        estimate_memory(plan_args(cfg, zero_stage=2, offload_optimizer="cpu",
                                  offload_optimizer_ratio=0.5))
