"""ZeRO-3 partial optimizer offload (`--offload-optimizer-ratio`): config and planner."""
from __future__ import annotations

import json

import pytest

from megazoo.config.ds_config import build_ds_config
from megazoo.models import resolve_config
from megazoo.plan import estimate_memory
from megazoo.plan.deepspeed_host import sub_groups

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


def test_planner_moves_whole_sub_groups_to_the_gpu():
    """DeepSpeed steps the first int((1 - ratio) x count) sub-groups on the GPU (16 B per
    element there: fp32 master, m, v, fp32 gradient); gpt-1.3b has two (1.0e9 elements and
    the rest), so 0.75 keeps none on the GPU and 0.5 the first."""
    cfg = resolve_config("gpt-1.3b")
    full, r75, r50 = (estimate_memory(plan_args(cfg, zero_stage=3, offload_optimizer="cpu",
                                                offload_optimizer_ratio=None if r == 1 else r))
                      for r in (1.0, 0.75, 0.5))
    groups = sub_groups(cfg, 1, 1)
    assert len(groups) == 3 and groups[0] >= 1e9 > groups[1] > groups[2]  # + the 1-D group
    assert (r75.host_per_gpu, r75.optimizer_states) == (full.host_per_gpu, 0)
    assert r50.optimizer_states == 16 * groups[0]
    # the host no longer holds its masters, m and v (12 B), nor its bf16 copy in the step
    assert full.host_per_gpu - r50.host_per_gpu == pytest.approx(
        12 * groups[0] + 2 * (groups[0] - groups[1]))
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):  # the run's own check
        estimate_memory(plan_args(cfg, zero_stage=2, offload_optimizer="cpu",
                                  offload_optimizer_ratio=0.5))
