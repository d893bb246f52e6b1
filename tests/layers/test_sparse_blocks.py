"""The Triton small-block kernel (`sparse/blocks.py`, `kernels/triton_sparse.py`): its walks list
each (query block, key block) pair of the layout exactly once on both sides, and its outputs and
q / k / v gradients equal the dense-mask float32 reference for every mode, block 16 / 32 / 64,
per-head layouts, causal and bidirectional, odd lengths and GQA (on CPU under Triton's
interpreter, float32; on a GPU in bf16)."""
from __future__ import annotations

import pytest
import torch

from megazoo.config.sparse_attention import SparseAttentionConfig as Config
from megazoo.layers.sparse import SparseAttention, choose_plan, sparse_attention
from megazoo.layers.sparse.blocks import BlocksPlan, _walk, build_blocks_plan, to_sub_blocks, walks
from megazoo.layers.sparse.strided import strided_plan

from helpers.sparse_checks import outputs_and_grads

# float32 on both sides: the kernel sums the same terms in another order (~1e-6 apart); a pair
# scored twice or missed moves outputs by ~1e-2.
TOL = 2e-5
MODES = {
    "fixed": dict(num_local_blocks=4, num_global_blocks=1, num_different_global_patterns=2),
    "bigbird": dict(num_sliding_window_blocks=3, num_global_blocks=1, num_random_blocks=2),
    "bslongformer": dict(num_sliding_window_blocks=3, global_block_indices=[0, 3]),
    "variable": dict(num_random_blocks=1, local_window_blocks=[2, 3], global_block_indices=[1]),
}


def _layout(mode, block, s, causal=True, heads=4):
    keys = dict(MODES[mode], mode=mode, block=block, different_layout_per_head=True,
                attention="unidirectional" if causal else "bidirectional")
    return SparseAttention(Config.from_ds_config(keys), heads, causal=causal, seed=5).layout(s)


def _unwalk(lists, shape, per_tile, per_chunk) -> torch.Tensor:
    """int [hp, n, m]: how often the walk (count, index, bits) lists each (row, column)."""
    count, index, bits = lists
    got = torch.zeros(shape, dtype=torch.long)
    for h in range(count.shape[0]):
        for t in range(count.shape[1]):
            for c in range(int(count[h, t])):
                for i in range(per_tile):
                    for j in range(per_chunk):
                        if int(bits[h, t, c]) >> (i * per_chunk + j) & 1:
                            got[h, t * per_tile + i, int(index[h, t, c, j])] += 1
    return got


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("block, block_m, block_n", [(16, 64, 64), (32, 64, 32), (16, 32, 128)])
def test_walks_list_each_pair_once(mode, block, block_m, block_n):
    s = 1000  # not a multiple of the tiles: a short last tile on both sides
    lay = _layout(mode, block, s)
    plan_rows, plan_cols = walks(lay, block, s, True, block_m, block_n)
    n = -(-s // 16)
    want = (to_sub_blocks(lay, block)[:, :n, :n] & torch.ones(n, n, dtype=torch.bool).tril()).long()
    rm, rn = block_m // 16, block_n // 16
    rows = _unwalk(plan_rows, (want.shape[0], -(-n // rm) * rm, n), rm, rn)
    cols = _unwalk(plan_cols, (want.shape[0], -(-n // rn) * rn, n), rn, rm)
    assert torch.equal(rows[:, :n], want) and rows[:, n:].sum() == 0
    assert torch.equal(cols[:, :n].transpose(1, 2), want) and cols[:, n:].sum() == 0


def test_walk_order_and_padding():
    lay = torch.zeros(1, 4, 8, dtype=torch.bool)
    lay[0, 0, [1, 6]] = True
    lay[0, 1, [6, 7]] = True
    count, index, bits = _walk(lay, 2, 2)
    assert count.tolist() == [[2, 0]]
    assert index[0, 0].tolist() == [[1, 6], [7, 0]]  # in order; the padding slot reads block 0
    assert bits[0, 0].tolist() == [0b1011, 0b0100]  # bit i * 2 + j: row i against slot j


def test_tiles_beyond_the_bits_are_refused():
    with pytest.raises(ValueError, match="at most 63"):
        walks(torch.ones(1, 4, 4, dtype=torch.bool), 16, 64, True, 128, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        to_sub_blocks(torch.ones(1, 4, 4, dtype=torch.bool), 8)


@pytest.mark.triton
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_dense_mask_reference(mode, block, causal, triton_device):
    s = 300 if block < 64 else 320  # odd lengths: not a multiple of 64 (block 64: of 128)
    lay = _layout(mode, block, s, causal)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 2, 4, 16, generator=g)
    k, v = (torch.randn(s, 2, 2, 16, generator=g) for _ in range(2))  # GQA 4 / 2
    grad = torch.randn(s, 2, 4, 16, generator=g)
    want = outputs_and_grads(lay, block, causal, q, k, v, grad, "math")
    q, k, v, grad = (t.to(triton_device) for t in (q, k, v, grad))
    plan = build_blocks_plan(lay.to(triton_device), block, s, causal)
    got = outputs_and_grads(lay, block, causal, q, k, v, grad, "triton", plan)
    tol = TOL if triton_device.type == "cpu" else 2e-3  # GPU: tf32 dots
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, atol=tol * 10, rtol=tol)


@pytest.mark.triton
def test_module_runs_the_kernel_and_rows_without_keys_output_zero(triton_device):
    """SparseAttention(backend="triton") builds the plan once per length; a bidirectional layout
    with an empty row gives zeros there (as the math path)."""
    cfg = Config.from_ds_config(dict(mode="bslongformer", block=16, attention="bidirectional",
                                     num_sliding_window_blocks=1, global_block_indices=[0]))
    attn = SparseAttention(cfg, 2, causal=False, backend="triton")
    q, k, v = (torch.randn(64, 1, 2, 16, device=triton_device) for _ in range(3))
    want = outputs_and_grads(attn.layout(64), 16, False, q.cpu(), k.cpu(), v.cpu(),
                             torch.ones(64, 1, 2, 16), "math")[0]
    tol = 1e-4 if triton_device.type == "cpu" else 2e-3  # GPU: tf32 dots
    torch.testing.assert_close(attn(q, k, v).cpu(), want, atol=tol, rtol=tol)
    assert len(attn._prepared) == 1
    lay = attn.layout(64).clone()
    lay[:, 2] = False  # row block 2 sees nothing
    out = sparse_attention(q, k, v, lay, 16, causal=False, backend="triton")
    assert out[32:48].abs().max() == 0 and out[:32].abs().min() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bigbird", "variable"])
def test_gpu_auto_takes_the_kernel_and_equals_reference(mode):
    """On CUDA "auto" takes the Triton plan for a block-16 layout that is not strided (not with
    ALiBi); bf16 output and gradients within 2 % of the largest float32 reference value."""
    s, dev = 2048, torch.device("cuda")
    lay = _layout(mode, 16, s)
    plan = choose_plan(lay, 16, True, s, dev, head_dim=128)
    assert isinstance(plan, BlocksPlan)
    assert not isinstance(choose_plan(lay, 16, True, s, dev, head_dim=128, alibi=True), BlocksPlan)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, grad = (torch.randn(s, 1, 4, 128, device=dev, generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    want = outputs_and_grads(lay, 16, True, q, k, v, grad, "math")
    got = outputs_and_grads(lay, 16, True, q, k, v, grad, "auto", plan)
    for got, want in zip(got, want):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 2e-2, float(err)


SEEDS = {"mode": "fixed", "block": 16, "different_layout_per_head": True}


@pytest.mark.triton
@pytest.mark.parametrize("keys, s, hk", [
    (SEEDS, 1024, 4),  # DeepSpeed's defaults: windows of 4 blocks, the last one global
    (dict(SEEDS, num_different_global_patterns=2), 1000, 2),  # per-head offsets, GQA, short tile
    (dict(SEEDS, block=32, num_local_blocks=8, num_global_blocks=2), 1024, 4),
    (dict(SEEDS, block=64, num_local_blocks=4, num_global_blocks=2), 1024, 2)])
def test_strided_plan_on_the_kernel_equals_dense_mask_reference(keys, s, hk, triton_device):
    """The strided plan with its local part, the merge and the gradient sums on the Triton
    kernel (global part: float32 math on CPU, cuDNN on a GPU)."""
    cfg = Config.from_ds_config(dict(keys, attention="unidirectional"))
    lay = SparseAttention(cfg, 4, causal=True, seed=3).layout(s)
    plan = strided_plan(lay.to(triton_device), cfg.block, s, True)
    assert plan is not None
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 2, 4, 16, generator=g)
    k, v = (torch.randn(s, 2, hk, 16, generator=g) for _ in range(2))
    grad = torch.randn(s, 2, 4, 16, generator=g)
    want = outputs_and_grads(lay, cfg.block, True, q, k, v, grad, "math")
    q, k, v, grad = (t.to(triton_device) for t in (q, k, v, grad))
    got = outputs_and_grads(lay, cfg.block, True, q, k, v, grad, "triton", plan)
    tol = TOL if triton_device.type == "cpu" else 2e-3  # GPU: tf32 dots
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, atol=tol * 10, rtol=tol)
