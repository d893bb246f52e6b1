"""Local attention in one process: every backend against the math reference, the tp=1
ParallelAttention against plain torch ops (with transformers' ALiBi and RoPE), BLOOM's
padded ALiBi, backend selection, dropout.

Tolerance (fp32): rtol 1e-5, atol 1e-5 x the largest entry of the expected tensor (`close`).
SDPA and FlexAttention reorder the same float32 sums (fused softmax, other matmul blocking);
with scores of O(1-10) (inputs scaled by 2) observed differences are ~1e-6 relative to the
largest gradient, a few ulps of the accumulated magnitude. A wrong mask, slope, position or
head moves results by >1e-2 relative.
"""
import itertools
import warnings

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from megazoo.layers import (AttentionConfig, NormalInit, ParallelAttention, alibi_slopes,
                            core_attention)
from megazoo.layers.attention import AttentionRequest, select_backend, unsupported_reason
from megazoo.layers import attention_kernels

S, B, D = 12, 2, 8


def close(got, want):
    """rtol 1e-5; atol 1e-5 times the largest entry (at least 1) of the expected tensor."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _mask():
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :4] = False  # left padding (queries 0..3 see no key)
    mask[1, -3:] = False  # right padding
    return mask


def _qkv(hq, hk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, h, D, generator=g) * 2 for h in (hq, hk, hk)]


FEATURES = list(itertools.product([True, False], [False, True], [False, True], [(6, 6), (6, 2), (6, 1)]))


@pytest.mark.parametrize("causal, padded, alibi, heads", FEATURES)
def test_sdpa_matches_math_with_gradients(causal, padded, alibi, heads):
    kw = dict(causal=causal, padding_mask=_mask() if padded else None,
              alibi_slopes=alibi_slopes(heads[0]) if alibi else None)
    ref_in = [t.requires_grad_() for t in _qkv(*heads)]
    sdpa_in = [t.detach().clone().requires_grad_() for t in ref_in]
    ref = core_attention(*ref_in, backend="math", **kw)
    out = core_attention(*sdpa_in, backend="sdpa", **kw)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    close(out, ref)
    for a, b in zip(sdpa_in, ref_in):
        close(a.grad, b.grad)


@pytest.mark.parametrize("causal, padded, alibi, heads", FEATURES)
def test_flex_matches_math_forward_on_cpu(causal, padded, alibi, heads):
    """FlexAttention has no CPU backward in torch 2.13: forward here, gradients in the GPU test."""
    kw = dict(causal=causal, padding_mask=_mask() if padded else None,
              alibi_slopes=alibi_slopes(heads[0]) if alibi else None)
    q, k, v = _qkv(*heads)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": expected on CPU
        out = core_attention(q, k, v, backend="flex", **kw)
    close(out, core_attention(q, k, v, backend="math", **kw))


def _requests():
    for device, dtype, head_dim, *flags, capability in itertools.product(
            ["cpu", "cuda"], [torch.float32, torch.bfloat16], [4, 64, 100, 512], *[[False, True]] * 4,
            [(8, 0), (9, 0), (10, 0)]):
        yield AttentionRequest(device, dtype, head_dim, *flags,
                               capability if device == "cuda" else (0, 0))


@pytest.mark.parametrize("flash_installed", [False, True])
def test_auto_never_picks_a_backend_that_cannot(monkeypatch, flash_installed):
    monkeypatch.setattr(attention_kernels, "flash_available", lambda: flash_installed)
    for req in _requests():
        chosen = select_backend("auto", req)
        assert unsupported_reason(chosen, req) is None, (req, chosen)
        if (req.alibi and req.device_type == "cuda" and not req.dropout and req.head_dim >= 16
                and chosen != "flash"):
            assert chosen == "flex", req  # ALiBi on GPU never materialises an s x s bias
        if req.device_type == "cpu":
            assert chosen == "sdpa", req
        if req.device_type == "cuda" and not req.alibi:
            # Hopper on: SDPA (cuDNN) beats flash-attn 2; before: flash-attn when installed
            hopper = req.capability >= (9, 0)
            expect_flash = flash_installed and not hopper and unsupported_reason("flash", req) is None
            assert chosen == ("flash" if expect_flash else "sdpa"), req


@pytest.mark.parametrize("backend, request_kw, fragment", [
    ("flex", dict(dropout=True), "no attention dropout"),
    ("flex", dict(requires_grad=True), "no backward on CPU"),
    ("flash", dict(), "CUDA only"),
    ("flex", dict(device_type="cuda", head_dim=8), "head_dim >= 16"),
])
def test_explicit_backend_that_cannot_raises(backend, request_kw, fragment):
    req = dict(device_type="cpu", dtype=torch.float32, head_dim=64, alibi=True, padding=False,
               dropout=False, requires_grad=False)
    req.update(request_kw)
    with pytest.raises(ValueError, match=fragment):
        select_backend(backend, AttentionRequest(**req))


def test_bloom_alibi_with_padding_matches_transformers_formula():
    """BLOOM: scores = q k^T / sqrt(d) + slope * (cumsum(mask) - 1), masked, fp32 softmax."""
    heads = 6
    q, k, v = _qkv(heads, heads)
    mask = _mask()
    alibi = build_alibi_tensor(mask.long(), heads, torch.float32).view(B, heads, 1, S)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = qb @ kb.transpose(-1, -2) / D ** 0.5 + alibi
    visible = torch.ones(S, S, dtype=torch.bool).tril() & mask[:, None, None, :]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    bloom = (probs @ vb).permute(2, 0, 1, 3)
    ours = core_attention(q, k, v, padding_mask=mask, alibi_slopes=alibi_slopes(heads))
    close(ours, bloom)


def _plain_block(layer, x, heads, kv, pe, mask, positions):
    """The block from its documented layout with plain torch ops and transformers' helpers."""
    s, b, _ = x.shape
    g = heads // kv
    qkv = (x @ layer.qkv.weight.T + layer.qkv.bias).view(s, b, kv, g + 2, D)
    q = qkv[:, :, :, :g].reshape(s, b, heads, D).permute(1, 2, 0, 3)  # [b, H, s, d]
    k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in (g, g + 1))  # [b, K, s, d]
    if pe == "rope":
        config = LlamaConfig(hidden_size=heads * D, num_attention_heads=heads, rope_theta=10000.0)
        cos, sin = LlamaRotaryEmbedding(config)(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q @ k.transpose(-1, -2) / D ** 0.5
    if pe == "alibi":
        scores = scores + build_alibi_tensor(mask.long(), heads, torch.float32).view(b, heads, 1, s)
    visible = torch.ones(s, s, dtype=torch.bool).tril() & mask[:, None, None, :]
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    probs = scores.softmax(-1) * visible.any(-1, keepdim=True)  # no visible key: output 0
    context = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, heads * D)
    return context @ layer.dense.weight.T + layer.dense.bias


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("heads, kv, pe", [(6, 6, "alibi"), (8, 2, "rope"), (4, 1, "rope"), (4, 4, "none")])
def test_block_matches_plain_torch(backend, heads, kv, pe):
    layer = ParallelAttention(AttentionConfig(heads * D, heads, num_kv_heads=kv,
                                              position_embedding=pe, attention_backend=backend),
                              init_method=NormalInit(0.3, 1, "qkv"),
                              output_init_method=NormalInit(0.2, 1, "dense"))
    with torch.no_grad():
        layer.qkv.bias.normal_()
        layer.dense.bias.normal_()
    x = torch.randn(S, B, heads * D, requires_grad=True)
    mask = _mask()
    positions = torch.stack([torch.arange(S) + 2, torch.cat([torch.arange(7), torch.arange(S - 7)])])
    y = layer(x, padding_mask=mask, position_ids=positions)
    grads = torch.autograd.grad(y.square().sum(), [x] + list(layer.parameters()))
    y_ref = _plain_block(layer, x, heads, kv, pe, mask, positions)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x] + list(layer.parameters()))
    close(y, y_ref)
    for got, want in zip(grads, grads_ref):
        close(got, want)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = ParallelAttention(AttentionConfig(32, 4, attention_dropout=0.5),
                              init_method=NormalInit(0.3, 2))
    x = torch.randn(S, B, 32)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    torch.manual_seed(1)
    y_train = layer(x)
    torch.manual_seed(1)
    assert torch.equal(layer(x), y_train)  # dropout follows torch's generator
    assert not torch.allclose(y_train, y_eval)
    layer.attention.attention_dropout = 0.0
    torch.testing.assert_close(layer(x), y_eval)


def test_bad_arguments():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ParallelAttention(AttentionConfig(32, 4, attention_backend="xformers"))
    with pytest.raises(ValueError, match="position_embedding must be one of"):
        ParallelAttention(AttentionConfig(32, 4, position_embedding="learned"))
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        ParallelAttention(AttentionConfig(30, 4))
    q, k, v = _qkv(6, 4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        core_attention(q, k, v)
    q, k, v = _qkv(6, 6)
    with pytest.raises(ValueError, match="padding_mask must be bool"):
        core_attention(q, k, v, padding_mask=torch.ones(B, S))
