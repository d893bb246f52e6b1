"""ALiBi slopes against transformers' BLOOM, RoPE against transformers' LLaMA, and the pure
head/row arithmetic of HeadLayout (single process)."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from megazoo.layers import HeadLayout, alibi_bias, alibi_slopes, apply_rope, rope_cos_sin


@pytest.mark.parametrize("heads", list(range(1, 21)) + [24, 32, 48, 96, 112])
def test_alibi_slopes_match_bloom(heads):
    mask = torch.ones(1, 2, dtype=torch.long)
    hf = build_alibi_tensor(mask, heads, torch.float32)  # [heads, 1, 2]: slope * position
    # HF raises a float32 base to integer powers; we round 2^(-8k/n) once: within an ulp or so.
    torch.testing.assert_close(alibi_slopes(heads), hf[:, 0, 1], rtol=1e-6, atol=0)


def test_alibi_bias_is_bloom_up_to_a_row_constant():
    slopes = alibi_slopes(6)
    bias = alibi_bias(slopes, 5, 5)  # [6, 5, 5]
    bloom = slopes[:, None, None] * torch.arange(5.0)  # BLOOM: slope * key position
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    diff = (bias - bloom).masked_fill(~causal, float("nan"))  # per row: -slope * i
    torch.testing.assert_close(diff.nanmean(-1, keepdim=True).expand_as(diff)[..., causal],
                               diff[..., causal])


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_llama(theta):
    b, heads, s, d = 2, 3, 7, 16
    config = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, rope_theta=theta,
                         max_position_embeddings=64)
    positions = torch.stack([torch.arange(s) + 3, torch.tensor([0, 1, 2, 0, 1, 2, 3])])
    q, k = torch.randn(b, heads, s, d), torch.randn(b, heads, s, d)
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, positions)  # [b, s, d]
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(positions, d, theta)  # [s, b, d]
    torch.testing.assert_close(cos, cos_hf.transpose(0, 1), rtol=0, atol=0)
    to_sbhd = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731  [b, h, s, d] -> [s, b, h, d]
    q_rot, k_rot = apply_rope(to_sbhd(q), to_sbhd(k), cos, sin)
    torch.testing.assert_close(q_rot, to_sbhd(q_hf), rtol=0, atol=0)
    torch.testing.assert_close(k_rot, to_sbhd(k_hf), rtol=0, atol=0)


def test_fused_rows_split_kv_groups():
    # H=4, K=2, d=1: tp=1 rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert HeadLayout(4, 2, 1).qkv_rows(0).tolist() == list(range(8))
    tp2 = HeadLayout(4, 2, 1, tp=2)
    assert [tp2.qkv_rows(r).tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not tp2.replicated_kv()


def test_fused_rows_replicate_kv_heads():
    tp4 = HeadLayout(4, 2, 1, tp=4)  # each rank: one q head and a copy of its group's k, v
    assert [tp4.qkv_rows(r).tolist() for r in range(4)] == [[0, 2, 3], [1, 2, 3], [4, 6, 7], [5, 6, 7]]
    assert tp4.replicated_kv() and tp4.qkv_rows_per_rank == 3
    mqa = HeadLayout(8, 1, 2, tp=2)  # [q0..q7 k v] x 2 rows each
    assert mqa.qkv_rows(1).tolist() == list(range(8, 16)) + list(range(16, 20))


def test_head_offsets_and_ulysses_send_index():
    lay = HeadLayout(12, 12, 4, tp=2, sp=2)
    assert [lay.first_head(t, s) for t in range(2) for s in range(2)] == [0, 3, 6, 9]
    assert lay.ulysses_send_index() is None  # 6 local groups split 3 + 3: plain slices
    gqa = HeadLayout(8, 2, 1, tp=2, sp=2)  # per tp rank: one group [q q q q k v]
    assert gqa.sp_groups == (1, 2)
    assert gqa.ulysses_send_index().tolist() == [0, 1, 4, 5, 2, 3, 4, 5]


@pytest.mark.parametrize("args, fragment", [
    ((12, 12, 4, 5, 1), r"not divisible by tp\*sp"),
    ((12, 12, 4, 2, 4), r"not divisible by tp\*sp"),
    ((12, 8, 4, 1, 1), "multiple of num_kv_heads"),
    ((24, 6, 4, 4, 1), "cannot be split over 4 ranks"),
    ((24, 3, 4, 1, 2), "cannot be split over 2 ranks"),
])
def test_head_layout_rejects_bad_sizes(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        HeadLayout(*args)
