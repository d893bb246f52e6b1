"""The strided plan (`sparse/strided.py`): which layouts it recognises, that its global and
local parts cover each (query, key) pair of the layout exactly once, and that its outputs and
q / k / v gradients equal the dense-mask float32 reference (CPU, float32 kernels)."""
from __future__ import annotations

import pytest
import torch

from megazoo.config.sparse_attention import SparseAttentionConfig as Config
from megazoo.layers.sparse import SparseAttention, choose_plan
from megazoo.layers.sparse import token_mask
from megazoo.layers.sparse.strided import StridedPlan, strided_plan
from megazoo.layers.sparse.strided import local_visible as _local_visible

from helpers.sparse_checks import assert_plan_equals_math, outputs_and_grads

# Same tolerances as the rectangles' checks: the parts' softmaxes merged by log-sum-exp are
# the reference's terms in another order (~1e-6 apart); a pair scored twice or missed moves
# outputs by ~1e-2.
TOL = 2e-5
SEEDS = {"mode": "fixed", "block": 16, "different_layout_per_head": True}
FIXED = [dict(SEEDS),  # DeepSpeed's defaults: windows of 4 blocks, the last one global
         dict(SEEDS, num_different_global_patterns=2),  # per-head global offsets
         dict(SEEDS, block=32, num_local_blocks=8, num_global_blocks=2),
         dict(SEEDS, block=64, num_local_blocks=4, num_global_blocks=2)]


def _layout(keys, s, heads=4, attention="unidirectional"):
    cfg = Config.from_ds_config(dict(keys, attention=attention))
    return cfg, SparseAttention(cfg, heads, causal=attention == "unidirectional", seed=3).layout(s)


def _pairs(plan: StridedPlan, s: int) -> torch.Tensor:
    """int [hp, s, s]: how many times each (query, key) pair is computed by the two parts."""
    hp = plan.rank.shape[0]
    q = torch.arange(s)[None, :, None]
    k = torch.arange(s)[None, None, :]
    local = _local_visible(plan, torch.arange(hp)[:, None, None], q, k).long()
    glob = torch.zeros(hp, s, s, dtype=torch.long)
    for h in range(hp):
        pos = plan.key_pos[h if plan.key_pos.shape[0] > 1 else 0]
        for r in range(s):
            m = r // plan.ratio
            if m >= plan.per_window:
                glob[h, r, pos[: m - plan.per_window + 1]] += 1
    return local + glob


@pytest.mark.parametrize("keys", FIXED)
@pytest.mark.parametrize("s", [1000, 1024])  # 1000: not a multiple of the window or tile
def test_parts_cover_each_pair_once(keys, s):
    cfg, lay = _layout(keys, s)
    plan = strided_plan(lay, cfg.block, s, True)
    assert plan is not None
    want = token_mask(lay, cfg.block)[:, :s, :s] & torch.ones(s, s, dtype=torch.bool).tril()
    got = _pairs(plan, s)
    assert got.max() == 1
    assert torch.equal(got.bool().expand_as(want), want)


@pytest.mark.parametrize("keys", FIXED)
@pytest.mark.parametrize("s, b", [(1000, 2), (1100, 1)])
def test_equals_dense_mask_reference(keys, s, b):
    cfg, lay = _layout(keys, s)
    plan = strided_plan(lay, cfg.block, s, True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, 16, generator=g) for h in (4, 2, 2))  # GQA 4 / 2
    grad = torch.randn(s, b, 4, 16, generator=g)
    assert_plan_equals_math(lay, cfg.block, True, plan, q, k, v, grad, TOL)


def test_recognises_only_strided_layouts():
    s = 1024
    for mode, keys in (("bigbird", {}), ("bslongformer", {}),
                       ("variable", {"local_window_blocks": [4]})):
        cfg, lay = _layout(dict(keys, mode=mode, block=16), s)
        assert strided_plan(lay, 16, s, True) is None, mode
    cfg, lay = _layout(SEEDS, s, attention="bidirectional")
    assert strided_plan(lay, 16, s, False) is None
    cfg, lay = _layout(SEEDS, 1002)
    assert strided_plan(lay, 16, 1002, True) is None  # not a multiple of R = 4
    cfg, lay = _layout(dict(SEEDS, num_local_blocks=3), s)
    assert strided_plan(lay, 16, s, True) is None  # R = 3: 1024 queries do not split in 3
    cfg, lay = _layout(SEEDS, s)
    lay = lay.clone()
    lay[:, 8:, 1] = True  # one more global block, in window 0 only: windows differ
    assert strided_plan(lay, 16, s, True) is None


def test_auto_takes_it_for_the_seeds_but_not_with_alibi():
    s = 1024
    cfg, lay = _layout(SEEDS, s)
    plan = choose_plan(lay, 16, True, s, torch.device("cpu"))
    assert isinstance(plan, StridedPlan)
    assert (plan.window, plan.ratio, plan.per_window) == (64, 4, 16)
    assert plan.key_pos.shape == (1, s // 4 - 16)  # heads share one table
    assert not isinstance(choose_plan(lay, 16, True, s, torch.device("cpu"), alibi=True),
                          StridedPlan)


@pytest.mark.gpu
@pytest.mark.parametrize("keys, hk", [(SEEDS, 4), (FIXED[1], 2), (dict(SEEDS, num_local_blocks=32), 4)])
def test_gpu_strided_equals_dense_mask_reference(keys, hk):
    """On CUDA (cuDNN causal for the global part, FlexAttention for the local part), bf16:
    output and q / k / v gradients within 2 % of the largest reference value of the float32
    dense-mask path on the same bf16 inputs (bf16 rounds each stored value by up to 0.4 %;
    a pair scored twice or missed is off by tens of percent)."""
    s, dev = 2048, torch.device("cuda")
    cfg, lay = _layout(keys, s)
    plan = choose_plan(lay, cfg.block, True, s, dev)
    assert isinstance(plan, StridedPlan)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(s, 1, h, 128, device=dev, generator=g, dtype=torch.bfloat16)
               for h in (4, hk, hk))
    grad = torch.randn(s, 1, 4, 128, device=dev, generator=g, dtype=torch.bfloat16)
    want = outputs_and_grads(lay, cfg.block, True, q, k, v, grad, "math")
    got = outputs_and_grads(lay, cfg.block, True, q, k, v, grad, "auto", plan)
    for got, want in zip(got, want):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 2e-2, float(err)
