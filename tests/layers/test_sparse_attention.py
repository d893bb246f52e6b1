"""Block-sparse attention: layouts (DeepSpeed's sparsity configs), config validation, the
FlexAttention BlockMask built from a layout, and outputs / input gradients against dense
attention with the equivalent boolean mask, on CPU."""
import warnings

import pytest
import torch

from megazoo.cli import sparse_layout as main
from megazoo.config.sparse_attention import SparseAttentionConfig as Config
from megazoo.layers.positions import alibi_slopes
from megazoo.layers.sparse import (SparseAttention, block_mask_from_layout, sparse_attention,
                                   tile_layout, token_mask)
from megazoo.layers.sparse.layouts import density, layout

# float32 math (and FlexAttention's eager float32 path) against a float64 reference over at
# most 320 keys of unit-variance inputs: rounding stays near 1e-6; 2e-5 leaves margin and
# still fails on any wrong mask entry (those change outputs by ~1e-1).
TOL = 2e-5

CASES = {  # a config per mode, with every mode-specific key away from its default
    "dense": dict(mode="dense"),
    "fixed": dict(mode="fixed", num_local_blocks=4, num_global_blocks=2),
    "variable": dict(mode="variable", num_random_blocks=2, local_window_blocks=[2, 3, 4],
                     global_block_indices=[1, 9], global_block_end_indices=[3, 11]),
    "bigbird": dict(mode="bigbird", num_random_blocks=2, num_sliding_window_blocks=3,
                    num_global_blocks=1),
    "bslongformer": dict(mode="bslongformer", num_sliding_window_blocks=5,
                         global_block_indices=[0, 12]),
}


def _config(mode, per_head, attention, block=16, **extra):
    keys = dict(CASES[mode], block=block, different_layout_per_head=per_head, **extra)
    if mode != "dense":
        keys["attention"] = attention
    if mode == "fixed" and per_head:
        keys["num_different_global_patterns"] = 2
    if mode in ("fixed", "variable") and attention == "bidirectional":
        keys["horizontal_global_attention"] = True
    return Config.from_ds_config(keys)


def _reference(q, k, v, block_layout, block, causal, slopes):
    """Dense softmax attention in float64 with the mask indexed from the layout per token."""
    s, hq = q.shape[0], q.shape[2]
    idx = torch.arange(s)
    mask = block_layout[:, idx[:, None] // block, idx[None, :] // block]  # [h, s, s]
    if causal:
        mask = mask & (idx[None, :] <= idx[:, None])
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    kd, vd = (t.repeat_interleave(hq // k.shape[2], dim=1) for t in (kd, vd))
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if slopes is not None:
        scores = scores - slopes.double()[:, None, None] * (idx[:, None] - idx[None, :]).abs()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probs.nan_to_num(0.0).matmul(vd).permute(2, 0, 1, 3)


def _inputs(s, b=2, hq=4, hk=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, hq, d, generator=g)
    k, v = (torch.randn(s, b, hk, d, generator=g) for _ in range(2))
    return q, k, v


MODE_ATTENTION = [(m, a) for m in CASES for a in ("unidirectional", "bidirectional")
                  if m != "dense" or a == "bidirectional"]  # dense has no 'attention' key


@pytest.mark.parametrize("mode, attention", MODE_ATTENTION)
@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_equals_dense_masked(mode, per_head, attention):
    """Outputs and input gradients of the sparse path (math fallback, with ALiBi and GQA) equal
    dense attention with the equivalent mask; FlexAttention's CPU forward equals it too."""
    cfg = _config(mode, per_head, attention)
    s, causal = 16 * 16, attention == "unidirectional"
    lay = layout(cfg, 4, s, seed=3, causal=causal)
    q, k, v = _inputs(s)
    slopes = alibi_slopes(4)
    ref = _reference(q, k, v, lay, 16, causal, slopes)
    qg, kg, vg = (t.clone().double().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(_reference(qg, kg, vg, lay, 16, causal, slopes), (qg, kg, vg), grad)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = sparse_attention(qs, ks, vs, lay, 16, causal=causal, alibi_slopes=slopes)
    grads = torch.autograd.grad(out, (qs, ks, vs), grad.float())
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=TOL * 10, rtol=0)  # summed over s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = sparse_attention(q, k, v, lay, 16, causal=causal, alibi_slopes=slopes, backend="flex")
    torch.testing.assert_close(flex.double(), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("block, lookup", [(32, None), (64, 16), (128, None), (256, 32)])
def test_flex_forward_at_every_tiling(block, lookup):
    """Blocks below the 128-token kernel tile (partial tiles) and multiples of it (whole
    tiles), the layout looked up at its block or at a finer granularity; a bidirectional
    layout made causal (token-level causality inside diagonal tiles)."""
    c = Config("bigbird", block, True, num_random_blocks=1, num_sliding_window_blocks=1)
    lay = layout(c, 4, 512, seed=1, causal=True)
    fine = lay if lookup is None else token_mask(lay, block // lookup)  # looked up finer
    mask = block_mask_from_layout(fine, lookup or block, causal=True)
    q, k, v = _inputs(512)
    ref = _reference(q, k, v, lay, block, True, None)
    torch.testing.assert_close(sparse_attention(q, k, v, lay, block).double(), ref, atol=TOL, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = sparse_attention(q, k, v, lay, block, backend="flex", block_mask=mask)
    torch.testing.assert_close(flex.double(), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("block, s", [(16, 600), (64, 600), (128, 600), (256, 600)])
def test_short_last_block(block, s):
    """s not a multiple of the block: the layout of s rounded up to the block, cut to s (math
    against the float64 reference; FlexAttention's forward over the cropped tiles too)."""
    c = Config("bigbird", block, True, num_random_blocks=1, num_sliding_window_blocks=1,
               attention="unidirectional")
    attn = SparseAttention(c, 4, seed=1)
    lay = attn.layout(s)
    assert lay.shape == (4, -(-s // block), -(-s // block))
    q, k, v = _inputs(s)
    ref = _reference(q, k, v, lay, block, True, None)
    torch.testing.assert_close(attn(q, k, v).double(), ref, atol=TOL, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = sparse_attention(q, k, v, lay, block, backend="flex")
    torch.testing.assert_close(flex.double(), ref, atol=TOL, rtol=0)


# ---- layouts: the semantics written per tile, independently of the vectorised code ----

def _fixed_tile(c, h, nb, r, col):
    uni, w, g = c.attention == "unidirectional", c.num_local_blocks, c.num_global_blocks
    first = w - (1 + h % c.num_different_global_patterns) * g
    starts = [w0 + first if w0 + w <= nb else max(0, min(w0 + first, nb - g)) for w0 in range(0, nb, w)]
    vertical = any(a <= col < a + g for a in starts)
    horizontal = c.horizontal_global_attention and any(a <= r < a + g for a in starts)
    return (r // w == col // w or vertical or horizontal) and (not uni or col <= r)


def _window_of(sizes, i):
    start, n = 0, 0
    while True:
        size = sizes[min(n, len(sizes) - 1)]
        if i < start + size:
            return n
        start, n = start + size, n + 1


def _ranges(c):
    ends = c.global_block_end_indices or [a + 1 for a in c.global_block_indices]
    return list(zip(c.global_block_indices, ends))


def _variable_tile(c, r, col):  # without random blocks
    uni = c.attention == "unidirectional"
    local = _window_of(c.local_window_blocks, r) == _window_of(c.local_window_blocks, col)
    glob = any(a <= col < b for a, b in _ranges(c))
    horizontal = c.horizontal_global_attention and any(a <= r < b for a, b in _ranges(c))
    return (local or glob or horizontal) and (not uni or col <= r)


def _window_tile(c, r, col):  # bigbird without random blocks, bslongformer
    near = abs(r - col) <= c.num_sliding_window_blocks // 2
    if c.mode == "bigbird":
        glob = r < c.num_global_blocks or col < c.num_global_blocks
    else:
        glob = any(a <= r < b or a <= col < b for a, b in _ranges(c))
    return (near or glob) and (c.attention == "bidirectional" or col <= r)


@pytest.mark.parametrize("attention", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("nb", [16, 19])  # 19: a short last window
def test_layouts_match_their_definition(attention, nb):
    bi = attention == "bidirectional"
    configs = [
        Config("fixed", 16, True, num_local_blocks=6, num_global_blocks=2, attention=attention,
               horizontal_global_attention=bi, num_different_global_patterns=3),
        Config("fixed", 16, False, num_local_blocks=5, attention=attention),
        Config("variable", 16, attention=attention, local_window_blocks=[2, 5, 3],
               global_block_indices=[0, 7], horizontal_global_attention=bi),
        Config("variable", 16, attention=attention, global_block_indices=[1, 8],
               global_block_end_indices=[4, 10]),
        Config("bigbird", 16, attention=attention, num_sliding_window_blocks=5, num_global_blocks=2),
        Config("bslongformer", 16, attention=attention, num_sliding_window_blocks=4,
               global_block_indices=[2, 11], global_block_end_indices=[4, 12]),
    ]
    for c in configs:
        got = layout(c, 3, nb * 16)
        for h in range(3):
            if c.mode == "fixed":
                want = [[_fixed_tile(c, h, nb, r, k) for k in range(nb)] for r in range(nb)]
            elif c.mode == "variable":
                want = [[_variable_tile(c, r, k) for k in range(nb)] for r in range(nb)]
            else:
                want = [[_window_tile(c, r, k) for k in range(nb)] for r in range(nb)]
            assert torch.equal(got[h], torch.tensor(want)), (c, h)


def test_layout_properties():
    nb, s = 24, 24 * 16
    bi = {m: _config(m, True, "bidirectional") for m in CASES}
    uni = {m: _config(m, True, "unidirectional") for m in CASES if m != "dense"}
    for m, c in uni.items():
        assert not layout(c, 4, s).triu(1).any(), m
    for m, c in bi.items():
        assert not layout(c, 4, s, causal=True).triu(1).any(), m
    for m in ("dense", "bslongformer"):
        lay = layout(bi[m], 4, s)
        assert torch.equal(lay, lay.transpose(1, 2)), m
    no_random = Config("bigbird", 16, num_sliding_window_blocks=7, num_global_blocks=2)
    lay = layout(no_random, 1, s)[0]
    assert torch.equal(lay, lay.T) and lay[:2].all() and lay[:, :2].all()
    assert lay[10].nonzero().flatten().tolist() == [0, 1, 7, 8, 9, 10, 11, 12, 13]
    # random blocks alone (window 1 = the diagonal): 3 distinct past blocks per row, or all
    # of them where fewer exist; the diagonal may be among them
    c = Config("bigbird", 16, True, num_random_blocks=3, num_sliding_window_blocks=1,
               num_global_blocks=0, attention="unidirectional")
    counts = layout(c, 4, s).sum(-1)  # [h, nb]
    assert (counts[:, :3] == torch.arange(1, 4)).all()
    assert ((counts[:, 3:] == 3) | (counts[:, 3:] == 4)).all() and (counts[:, 3:] == 4).any()
    assert density(layout(c, 4, s), 16, True) < density(layout(bi["dense"], 1, s, causal=True), 16, True)
    assert density(layout(bi["dense"], 1, s, causal=True), 16, True) == (s + 1) / (2 * s)


def test_seed_heads_and_slicing():
    c = _config("bigbird", True, "bidirectional")
    full = layout(c, 8, 512, seed=1)
    assert torch.equal(full, layout(c, 8, 512, seed=1))
    assert not torch.equal(full, layout(c, 8, 512, seed=2))
    assert not torch.equal(full[0], full[1])  # per-head random draws
    for h0, h1 in [(0, 2), (2, 4), (5, 8)]:
        assert torch.equal(layout(c, 8, 512, seed=1, heads=(h0, h1)), full[h0:h1])
    shared = layout(_config("bigbird", False, "bidirectional"), 8, 512, seed=1)
    assert all(torch.equal(shared[0], shared[h]) for h in range(8))
    fixed = layout(_config("fixed", True, "bidirectional"), 4, 512)
    assert torch.equal(fixed[0], fixed[2]) and not torch.equal(fixed[0], fixed[1])


def test_rank_heads_give_the_full_layers_output_slice():
    """A rank with heads [2, 4) (tp or Ulysses) computes the full layer's heads 2 and 3."""
    c = _config("variable", True, "unidirectional")
    q, k, v = _inputs(256, hq=4, hk=4)
    slopes = alibi_slopes(4)
    full = SparseAttention(c, 4, seed=5)(q, k, v, alibi_slopes=slopes)
    part = SparseAttention(c, 4, (2, 4), seed=5)(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:],
                                                 alibi_slopes=slopes[2:])
    torch.testing.assert_close(part, full[:, :, 2:], atol=0, rtol=0)


@pytest.mark.parametrize("block", [16, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_tiles_equal_create_block_mask(block, causal):
    """The BlockMask built from the layout has the partial and full 128-tiles that evaluating
    the token mask over s x s (create_block_mask) finds; 320 tokens: a short last tile."""
    from torch.nn.attention.flex_attention import create_block_mask
    s = {128: 384, 256: 768}.get(block, 320)
    c = Config("bigbird", block, True, num_random_blocks=1, num_sliding_window_blocks=3)
    lay = layout(c, 2, s, seed=0, causal=causal)
    idx = torch.arange(s)
    mask = lay[:, idx[:, None] // block, idx[None, :] // block] & ((idx[None, :] <= idx[:, None]) | (not causal))
    want = create_block_mask(lambda b, h, qi, ki: mask[h, qi, ki], 1, 2, s, s, device="cpu")
    got = block_mask_from_layout(lay, block, causal=causal)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    partial, full = tile_layout(lay, block, causal)
    assert not (partial & full).any()


@pytest.mark.parametrize("block, s", [(16, 600), (256, 600), (256, 384)])
def test_block_mask_tiles_of_a_short_sequence(block, s):
    """s not a multiple of the block: the cropped tiles equal create_block_mask's (384: the
    last block is short but every 128-tile is whole)."""
    from torch.nn.attention.flex_attention import create_block_mask
    c = Config("bigbird", block, True, num_random_blocks=1, num_sliding_window_blocks=1)
    lay = SparseAttention(c, 2, causal=True).layout(s)
    idx = torch.arange(s)
    mask = lay[:, idx[:, None] // block, idx[None, :] // block] & (idx[None, :] <= idx[:, None])
    want = create_block_mask(lambda b, h, qi, ki: mask[h, qi, ki], 1, 2, s, s, device="cpu")
    got = block_mask_from_layout(lay, block, causal=True, seq_len=s)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_config_round_trip_and_seed_section():
    seeds = {"mode": "fixed", "block": 16, "different_layout_per_head": True}
    c = Config.from_ds_config(seeds)
    assert (c.num_local_blocks, c.num_global_blocks, c.attention) == (4, 1, "bidirectional")
    for m in CASES:
        c = _config(m, True, "bidirectional")
        assert Config.from_ds_config(c.to_ds_config()) == c
    assert hash(_config("variable", True, "bidirectional"))


@pytest.mark.parametrize("keys, seq, message", [
    ({"mode": "sparse"}, 256, "unknown sparse attention mode 'sparse'"),
    ({"mode": "fixed", "num_random_blocks": 2}, 256, "unknown key(s) 'num_random_blocks'"),
    ({"mode": "bigbird", "windows": 2}, 256, "unknown key(s) 'windows'"),
    ({"block": 24}, 240, "power of two >= 16"),
    ({"block": 8}, 256, "integer >= 16"),
    ({"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3}, 256, "multiple of num_global_blocks"),
    ({"mode": "fixed", "num_different_global_patterns": 2}, 256, "needs different_layout_per_head"),
    ({"mode": "fixed", "attention": "unidirectional", "horizontal_global_attention": True}, 256,
     "needs attention='bidirectional'"),
    ({"mode": "variable", "attention": "causal"}, 256, "'attention' must be one of"),
    ({"mode": "variable", "global_block_indices": [3], "global_block_end_indices": [3]}, 256, "is empty"),
    ({"mode": "bigbird", "num_random_blocks": -1}, 256, "num_random_blocks must be an integer >= 0"),
    ({"mode": "bslongformer"}, 250, "sequence length 250 is not a multiple of the sparse attention block 16"),
    ({"mode": "bslongformer", "global_block_indices": [16]}, 256, "global block index 16 is beyond the 16 blocks"),
    ({"mode": "variable", "global_block_indices": [0], "global_block_end_indices": [17]}, 256,
     "global block index 17 is beyond"),
    ({"mode": "bigbird", "num_random_blocks": 20}, 256, "num_random_blocks=20 exceeds the 16 blocks"),
])
def test_bad_config_one_line(keys, seq, message):
    with pytest.raises(ValueError) as err:
        layout(Config.from_ds_config(keys), 4, seq)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_attention_inputs():
    lay = layout(Config("dense", 16), 4, 128)
    q, k, v = _inputs(128)
    with pytest.raises(ValueError, match=r"layout must be bool \[hq, ceil\(s/block\), ceil\(s/block\)\]"):
        sparse_attention(q, k, v, lay[:2], 16)
    with pytest.raises(ValueError, match="unknown sparse attention backend"):
        sparse_attention(q, k, v, lay, 16, backend="blocksparse")
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call"):
        sparse_attention(q, k, v, lay, 16, backend="triton", alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="FlexAttention has no backward on CPU"):
        sparse_attention(q.requires_grad_(), k, v, lay, 16, backend="flex")


def test_cli_picture_and_errors(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "layout.png"
    assert main(["--sparse-attention-mode", "bigbird", "--seq", "1024", "--sparse-block", "64",
                 "--heads", "2", "--causal", "--out", str(out)]) == 0
    assert out.stat().st_size > 0 and "density" in capsys.readouterr().out
    assert main(["--sparse-attention-mode", "fixed",
                 "--sparse-attention-config", '{"num_random_blocks": 2}']) == 2
    assert capsys.readouterr().err.count("\n") == 1
