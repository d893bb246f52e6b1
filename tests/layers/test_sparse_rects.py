"""Chunk rectangles over the gather plan's shared keys (sparse/rects.py) merged with the
FlexAttention part by log-sum-exp (sparse/merge.py), on CPU: the Flex part's mask evaluated
densely ("math" kernel), the rectangles on the float32 kernel, against the dense-mask float32
reference (outputs and q / k / v gradients) for every mode at blocks 16 / 32 / 64, per-head
layouts, causal and bidirectional, lengths that are not multiples of the block, GQA; the
rectangle pairs and the Flex part's pairs together are the layout exactly; the path is taken."""
import pytest
import torch

from megazoo.config.sparse_attention import SparseAttentionConfig as Config
from megazoo.layers.sparse import merge as sparse_merge
from megazoo.layers.sparse import SparseAttention
from megazoo.layers.sparse.gather import dense_mask as _dense, main_mask_mod, rows_mask_mod
from megazoo.layers.sparse.layouts import layout
from megazoo.layers.sparse.merge import merge_rects, rect_backward, rect_forward
from megazoo.layers.sparse.gather_plan import TILE, build_plan
from megazoo.layers.sparse.rects import RectPlan, add_rects, flex_tiles, rect_plan

from helpers.sparse_checks import assert_plan_equals_math

# Float32 everywhere, unit-variance inputs, at most ~1.3k keys per row: the merge sums the
# same softmax terms as the reference in another order (two partial softmaxes rescaled by
# exp(lse_i - L)), ~1e-6 apart; 2e-5 on outputs and 2e-4 on gradients (sums over s) leave
# margin, while one pair scored twice or missed moves outputs by ~1e-2 or more.
TOL = 2e-5
SEEDS = {"mode": "fixed", "block": 16, "different_layout_per_head": True}


def _config(mode, block, attention):
    """Per-head layouts with global columns (so segment 2 and rectangles exist) and the
    random blocks / global rows of each mode."""
    bi, n = attention == "bidirectional", max(2, 256 // block)  # n global blocks: >= 2 tiles
    spread = [1 + 2 * i for i in range(n)]
    keys = {"fixed": dict(num_local_blocks=4, num_global_blocks=1, num_different_global_patterns=2,
                          horizontal_global_attention=bi),
            "variable": dict(num_random_blocks=1, local_window_blocks=[2, 3],
                             global_block_indices=spread, horizontal_global_attention=bi),
            "bigbird": dict(num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=n),
            "bslongformer": dict(num_sliding_window_blocks=3, global_block_indices=spread)}[mode]
    return Config.from_ds_config(dict(keys, mode=mode, block=block, attention=attention,
                                      different_layout_per_head=True))


CASES = [(m, blk, a) for m in ("fixed", "variable", "bigbird", "bslongformer")
         for blk in (16, 32, 64) for a in ("unidirectional", "bidirectional")]
S = {16: 1000, 32: 1100, 64: 1200}  # not multiples of the block or of the 128-token tile


def _plan(cfg, s, causal, heads=4):
    lay = SparseAttention(cfg, heads, causal=causal, seed=3).layout(s)
    plan = build_plan(lay, cfg.block, s, causal)
    plan.rects = rect_plan(plan, chunk=TILE)  # forced: one chunk per tile, whatever it covers
    return plan, lay


def _compare(cfg, s, causal, plan, lay, hq=4, hk=2):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, h, 16, generator=g) for h in (hq, hk, hk))
    grad = torch.randn(s, 1, hq, 16, generator=g)
    assert_plan_equals_math(lay, cfg.block, causal, plan, q, k, v, grad, TOL)


@pytest.mark.parametrize("mode, block, attention", CASES)
def test_rects_equal_dense_mask(mode, block, attention):
    """Outputs and q / k / v gradients, 4 query heads on 2 kv heads, per-head layouts."""
    cfg, causal = _config(mode, block, attention), attention == "unidirectional"
    plan, lay = _plan(cfg, S[block], causal)
    _compare(cfg, S[block], causal, plan, lay)


def test_some_cases_have_rectangles():
    """The cases above exercise rectangles (causal prefixes and, bidirectional, columns after
    the chunk too), not only the empty merge: all but fixed bidirectional at blocks 16 / 32,
    whose global rows (one per 64 tokens) fall in every chunk and so leave no rectangle."""
    empty, later = [], False
    for mode, block, attention in CASES:
        plan, _ = _plan(_config(mode, block, attention), S[block], attention == "unidirectional")
        if plan.rects.pairs(plan.seq_len, plan.heads) == 0:
            empty.append((mode, block, attention))
        later |= any(k0 > 0 for runs in plan.rects.runs for k0, _ in runs)
    assert empty == [("fixed", 16, "bidirectional"), ("fixed", 32, "bidirectional")]
    assert later  # a run that does not start at segment 2's first key


@pytest.mark.parametrize("mode, block, attention", CASES[::3] + [("fixed", 16, "unidirectional")])
def test_rect_and_flex_pairs_are_the_layout(mode, block, attention):
    """Each (head, query, key) pair is scored once: the rectangles' pairs plus the Flex mask
    (which leaves them out) plus the dense rows equal the layout's mask; the Flex tiles drop
    every rectangle tile and still hold every pair the Flex mask sees."""
    causal = attention == "unidirectional"
    plan, lay = _plan(_config(mode, block, attention), S[block], causal)
    s, hp, rects = plan.seq_len, plan.heads, plan.rects
    idx = torch.arange(s)
    want = lay[:, idx[:, None] // block, idx[None, :] // block] & ((idx[None, :] <= idx[:, None]) | (not causal))
    seen = _dense(main_mask_mod(plan, rects), hp, s, plan.key_pos.shape[1], "cpu")  # [hp, s, K]
    for (q0, q1), runs in rects.chunks(s):
        for k0, k1 in runs:
            part = slice(rects.start + k0, rects.start + k1)
            assert not seen[:, q0:q1, part].any()
            seen[:, q0:q1, part] = True
    count = torch.zeros(hp, s, s + 1).scatter_add_(
        2, plan.key_pos[:, None, :].expand(hp, s, -1).clone(), seen.float())[:, :, :s]
    if plan.row_pos is not None:
        rows = _dense(rows_mask_mod(plan), hp, plan.row_pos.shape[1], s, "cpu")
        count.scatter_add_(1, plan.row_pos[:, :, None].expand(-1, -1, s).clone(), rows.float())
    assert torch.equal(count, want.float())
    partial, full = flex_tiles(plan, rects)
    flex = _dense(main_mask_mod(plan, rects), hp, s, plan.key_pos.shape[1], "cpu")
    grid = torch.zeros(hp, partial.shape[1] * TILE, partial.shape[2] * TILE, dtype=torch.bool)
    grid[:, :s, :flex.shape[2]] = flex
    assert (grid.view(hp, *partial.shape[1:2], TILE, -1, TILE).any(4).any(2) <= (partial | full)).all()
    assert int((plan.partial | plan.full).sum() - (partial | full).sum()) >= rects.pairs(s, 1) // TILE ** 2


def test_seeds_take_the_rectangles_and_call_the_kernel(monkeypatch):
    """The seeds' section (fixed, block 16, causal) at 8k on the gather plan (backend
    "gather"; "auto" takes the strided plan for it): `add_rects` gives rectangles with
    K_c > 0 (most of the shared keys), and the gather backend runs them (the kernel is
    called, forward and backward) with the reference's result."""
    lay = layout(Config.from_ds_config(SEEDS), 2, 8192, causal=True)
    plan = add_rects(build_plan(lay[:1], 16, 8192, True))
    assert plan is not None and plan.rects is not None and plan.rects.chunk == 1024
    # chunk c starts at 1024 c: the 16-token globals before it, one per 64 tokens, 256 c keys
    assert [runs[0] for runs in plan.rects.runs[1:4]] == [(0, 256), (0, 512), (0, 768)]
    assert plan.rects.pairs(8192, 1) > 0.8 * int((plan.key_code == 2).sum()) * 8192 / 2
    calls = []
    for name, real in (("rect_forward", rect_forward), ("rect_backward", rect_backward)):
        monkeypatch.setattr(sparse_merge, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    s = 2000  # a short plan of the same layout: chunk 128, K_c = 32 c rounded down to 128
    small = layout(Config.from_ds_config(SEEDS), 4, 2000, causal=True)
    plan = add_rects(build_plan(small[:1], 16, s, True), chunk=TILE, min_share=0.0)
    assert plan.rects.runs[4] == ((0, 128),) and plan.rects.runs[15] == ((0, 384),)
    _compare(Config.from_ds_config(SEEDS), s, True, plan, small)
    assert "rect_forward" in calls and "rect_backward" in calls


def test_rule_keeps_small_shares_on_flex():
    """`add_rects` sets rectangles only where they cover RECT_SHARE of the plan's tiles: with
    8 global blocks (one tile of shared keys) and 1k-token windows at 2k, rectangles of
    one-tile chunks would cover 14 of the plan's 97 tiles; with 128-token windows 14 of 44."""
    for window, taken in ((63, False), (3, True)):
        cfg = Config.from_ds_config(dict(mode="bslongformer", block=16, attention="unidirectional",
                                         num_sliding_window_blocks=window,
                                         global_block_indices=list(range(1, 17, 2))))
        lay = SparseAttention(cfg, 2, seed=3).layout(2048)
        plan = build_plan(lay[:1], 16, 2048, True)
        assert rect_plan(plan, chunk=TILE).pairs(2048, 1) == 14 * TILE ** 2
        assert (add_rects(plan, chunk=TILE).rects is not None) == taken


def test_math_kernel_backward_matches_autograd():
    """The written-out float32 rectangle backward (given its own O and L) equals autograd's
    gradient of the forward."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64).float().requires_grad_()
               for n in (40, 24, 24))
    dout = torch.randn(1, 2, 40, 8, generator=g)
    out, lse, aux = rect_forward("math", q, k, v, 0.3)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = rect_backward("math", dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), aux, 0.3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_merge_with_rows_the_flex_part_leaves_empty():
    """The merge alone: rows 128-159 see keys only through the rectangle (the Flex part gives
    them lse -inf and output 0), rows 0-31 see nothing at all: outputs and gradients equal one
    softmax over the union of the two masks, with no NaN (the float32 kernel)."""
    g = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(1, 2, 256, 8, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 2, 256, 8, generator=g)
    i = torch.arange(256)
    flex_mask = (i[None, :] >= 128) & (i[None, :] <= i[:, None]) & ~((i[:, None] >= 128) & (i[:, None] < 160))
    flex_mask &= (i[:, None] >= 32)[:, :1]  # rows 0-31: no key
    rect_mask = (i[:, None] >= 128) & (i[None, :] < 128)
    covered = torch.zeros(2, 2, dtype=torch.bool)
    covered[1, 0] = True
    rects = RectPlan(chunk=128, start=0, covered=covered, runs=((), ((0, 128),)))

    def masked(mask):
        scores = (q @ keys.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        probs = torch.where(mask, torch.exp(scores - lse[..., None]), 0.0)
        return probs @ values, lse

    out_f, lse_f = masked(flex_mask)
    got = merge_rects(q, keys, values, out_f, lse_f, rects, 0.3, "math")
    grads = torch.autograd.grad(got, (q, keys, values), dout)
    want = masked(flex_mask | rect_mask)[0]
    want_grads = torch.autograd.grad(want, (q, keys, values), dout)
    assert not got.isnan().any() and all(not t.isnan().any() for t in grads)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=10 * TOL, rtol=0)
