"""Block-sparse attention over gathered keys (sparse/gather_plan.py, sparse/gather.py) against dense
attention with the layout's mask: every mode at blocks 16 / 32 / 64, per-head layouts, causal
and bidirectional, sequence lengths that are not multiples of the block, ALiBi and GQA; the
plan's kernel tiles against its own mask evaluated everywhere; and the dispatch."""
import warnings

import pytest
import torch

from megazoo.layers.positions import alibi_slopes
from megazoo.layers.sparse import SparseAttention, choose_plan, sparse_attention
from megazoo.config.sparse_attention import SparseAttentionConfig as Config
from megazoo.layers.sparse.gather import dense_mask as _dense, gather_attention, main_mask_mod, rows_mask_mod
from megazoo.layers.sparse.layouts import layout
from megazoo.layers.sparse.gather_plan import NEVER, PRIVATE_BASE, SHARED, TILE, GatherPlan, build_plan
from megazoo.layers.sparse.strided import StridedPlan

# float32 math over gathered keys against the float32 dense-mask path (backend "math", itself
# checked against float64 in test_sparse_attention.py), unit-variance inputs, at most ~1.3k
# keys: the two sum the same terms in other orders, ~1e-6 apart; 2e-5 (outputs) and 2e-4
# (gradients, sums over s) leave margin, and a wrong mask entry moves outputs by ~1e-1.
TOL = 2e-5


def _inputs(s, b=1, hq=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, h, d, generator=g) for h in (hq, hk, hk))


def _reference(q, k, v, lay, block, causal, slopes):
    """The dense-mask path: the layout expanded to an explicit [h, s, s] mask, float32 math."""
    return sparse_attention(q, k, v, lay, block, causal=causal, alibi_slopes=slopes, backend="math")


def _config(mode, block, attention):
    """Per-head layouts (random blocks, fixed's global patterns) at sizes where the plan
    gathers: windows in place, global columns shared, random blocks private, global rows."""
    bi = attention == "bidirectional"
    keys = {"fixed": dict(num_local_blocks=4, num_global_blocks=1, num_different_global_patterns=2,
                          horizontal_global_attention=bi),
            "variable": dict(num_random_blocks=1, local_window_blocks=[2, 5, 3],
                             global_block_indices=[1, 6], global_block_end_indices=[2, 8],
                             horizontal_global_attention=bi),
            "bigbird": dict(num_random_blocks=2, num_sliding_window_blocks=3, num_global_blocks=1),
            "bslongformer": dict(num_sliding_window_blocks=5, global_block_indices=[0, 9])}[mode]
    return Config.from_ds_config(dict(keys, mode=mode, block=block, attention=attention,
                                      different_layout_per_head=True))


def _seq(block):
    """Not a multiple of the block (a short last block) nor of the 128-token kernel tile."""
    return {16: 600, 32: 650, 64: 700}[block]


CASES = [(m, blk, a) for m in ("fixed", "variable", "bigbird", "bslongformer")
         for blk in (16, 32, 64) for a in ("unidirectional", "bidirectional")]


@pytest.mark.parametrize("mode, block, attention", CASES)
def test_gather_equals_dense_mask(mode, block, attention):
    """Outputs and the gradients of q, k and v (ALiBi, 4 query heads on 2 kv heads)."""
    cfg, s, causal = _config(mode, block, attention), _seq(block), attention == "unidirectional"
    attn = SparseAttention(cfg, 4, causal=causal, seed=2, backend="gather")
    lay = attn.layout(s)
    q, k, v = _inputs(s)
    slopes = alibi_slopes(4)
    grad = torch.randn(s, 1, 4, 16, generator=torch.Generator().manual_seed(1))
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _reference(qd, kd, vd, lay, block, causal, slopes)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), grad)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = attn(qs, ks, vs, alibi_slopes=slopes)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad)
    torch.testing.assert_close(out, ref.detach(), atol=TOL, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=10 * TOL, rtol=0)


def _plan(mode, block, attention, heads=4):
    cfg, s = _config(mode, block, attention), _seq(block)
    causal = attention == "unidirectional"
    lay = SparseAttention(cfg, heads, causal=causal, seed=2).layout(s)
    return build_plan(lay, block, s, causal), lay


@pytest.mark.parametrize("mode, block, attention", CASES)
def test_plan_counts_each_pair_once_and_tiles_cover_it(mode, block, attention):
    """Summed over the gathered keys (and the dense rows), each (head, query, key) pair is
    seen as often as the layout's mask says (0 or 1); tiles marked full are all seen, and
    every seen element lies in a partial or full tile."""
    plan, lay = _plan(mode, block, attention)
    s, hp, causal = plan.seq_len, plan.heads, plan.causal
    idx = torch.arange(s)
    want = lay[:, idx[:, None] // block, idx[None, :] // block] & ((idx[None, :] <= idx[:, None]) | (not causal))
    main = _dense(main_mask_mod(plan), hp, s, plan.key_pos.shape[1], "cpu")  # [hp, s, K]
    count = torch.zeros(hp, s, s + 1).scatter_add_(2, plan.key_pos[:, None, :].expand(hp, s, -1).clone(),
                                                   main.float())[:, :, :s]
    tiles = [(main, plan.partial, plan.full)]
    if plan.row_pos is not None:
        rows = _dense(rows_mask_mod(plan), hp, plan.row_pos.shape[1], s, "cpu")  # [hp, R, s]
        count.scatter_add_(1, plan.row_pos[:, :, None].expand(-1, -1, s).clone(), rows.float())
        tiles.append((rows, plan.row_partial, plan.row_full))
    assert torch.equal(count, want.float())
    for seen, partial, full in tiles:
        n, m = partial.shape[1:]
        grid = torch.zeros(hp, n * TILE, m * TILE, dtype=torch.bool)
        grid[:, :seen.shape[1], :seen.shape[2]] = seen
        grid = grid.view(hp, n, TILE, m, TILE)
        assert not (partial & full).any()
        assert (grid.any(4).any(2) <= (partial | full)).all()
        assert grid.all(4).all(2)[full].all()


def test_plan_segments_are_used():
    """The configs above exercise every segment: shared global columns (fixed), private
    random blocks (bigbird), dense global rows (bidirectional bslongformer)."""
    fixed, _ = _plan("fixed", 16, "unidirectional")
    assert (fixed.key_code == SHARED).any()
    bigbird, _ = _plan("bigbird", 16, "unidirectional")
    assert (bigbird.key_code >= PRIVATE_BASE).any()
    rows, _ = _plan("bslongformer", 16, "bidirectional")
    assert rows.row_pos is not None and (rows.key_code != NEVER).any()


@pytest.mark.parametrize("mode, attention", [("fixed", "unidirectional"), ("bigbird", "bidirectional"),
                                             ("bslongformer", "bidirectional")])
def test_flex_forward_equals_math(mode, attention):
    """FlexAttention's (eager, CPU) forward over the plan's BlockMasks equals the math path."""
    plan, lay = _plan(mode, 32, attention)
    q, k, v = _inputs(plan.seq_len)
    slopes = alibi_slopes(4)
    want = _reference(q, k, v, lay, 32, plan.causal, slopes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        got = gather_attention(q, k, v, plan, scale=0.25, alibi_slopes=slopes, kernel="flex")
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_shared_plan_keeps_kv_heads_grouped():
    """Heads sharing one layout: a one-head plan over the 2 kv heads (no expansion) gives the
    same as the reference; the functional entry point takes the expanded layout."""
    cfg = Config.from_ds_config({"mode": "fixed", "block": 16, "different_layout_per_head": True})
    lay = layout(cfg, 4, 1024, causal=True)
    q, k, v = _inputs(1000, b=2)
    out = sparse_attention(q, k, v, lay[:, :63, :63], 16, backend="gather")
    torch.testing.assert_close(out, _reference(q, k, v, lay[:, :63, :63], 16, True, None), atol=TOL,
                               rtol=0)


def test_choose_plan():
    """The seeds' section at 8k with one more key block (so not the strided plan's windows,
    which "auto" takes for the section itself): the plan computes a fraction of the tiles in
    place, so auto gathers; a 128-block layout keeps its tiles."""
    seeds = Config.from_ds_config({"mode": "fixed", "block": 16, "different_layout_per_head": True})
    lay = layout(seeds, 2, 8192, causal=True)
    assert isinstance(choose_plan(lay, 16, True, 8192, "cpu"), StridedPlan)
    lay = lay[:1].clone()  # one layout for every head
    lay[:, 300, 5] = True
    plan = choose_plan(lay, 16, True, 8192, "cpu")
    assert isinstance(plan, GatherPlan) and plan.heads == 1
    partial, full = plan.tiles()
    assert full > 4 * partial and partial + full < 0.3 * 64 * 65 / 2
    big = Config("bslongformer", 128, num_sliding_window_blocks=3, attention="unidirectional")
    assert choose_plan(layout(big, 2, 8192, causal=True), 128, True, 8192, "cpu") is None


def test_bad_gather_requests():
    lay = layout(Config("bslongformer", 256, num_sliding_window_blocks=1), 4, 512)
    q, k, v = _inputs(512)
    with pytest.raises(ValueError, match="backend 'gather' needs a block dividing 128"):
        sparse_attention(q, k, v, lay, 256, backend="gather")
