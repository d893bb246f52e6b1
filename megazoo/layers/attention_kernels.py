"""Optional attention kernels, imported lazily: FlexAttention and flash-attn.

Both take the shapes of `attention.core_attention` (q [s, b, hq, d], k, v [s, b, hk, d]) and
return [s, b, hq, d]; the pure-PyTorch backends in attention.py compute the same function.

FlexAttention is compiled (torch.compile) on CUDA, once per process on first use (the
compiled callable and the causal block masks are cached). On CPU it runs eagerly, forward
only (torch 2.13 has no CPU backward for it): enough to check it computes the same function.
"""
from __future__ import annotations

import functools
import importlib.util

import torch


def flex_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


@functools.lru_cache(maxsize=1)
def flash_available() -> bool:
    """flash-attn importable (checked once; the import itself happens on first use)."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=2)
def _flex_function(compiled: bool):
    """flex_attention on [b, h, s, d] with an optional ALiBi score_mod (-slope * |i - j|).

    The score_mod is defined inside the function that gets compiled, so that its closure over
    `slopes` is traced as a tensor input rather than guarded on as a new function object
    (which would recompile on every call). Built once per process and mode.
    """
    from torch.nn.attention.flex_attention import flex_attention as flex

    def call(q, k, v, slopes, block_mask, scale, enable_gqa):
        score_mod = None
        if slopes is not None:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score - slopes[h] * (q_idx - kv_idx).abs()
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                    enable_gqa=enable_gqa)
    return torch.compile(call, dynamic=False) if compiled else call


@functools.lru_cache(maxsize=2)
def _flex_positions_function(compiled: bool):
    """flex_attention on [b, h, n, d] whose queries and keys sit at positions q_pos [hp, n_q]
    and k_pos [hp, n_k] (hp = 1: shared by every head), with ALiBi (-slope * |position
    distance|) when slopes are given: keys gathered out of order (sparse/gather.py)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    lse_keywords = _lse_request()  # built here: nothing imported under compile

    def call(q, k, v, slopes, q_pos, k_pos, block_mask, scale, enable_gqa, lse):
        score_mod = None
        if slopes is not None:
            qh, kh = q_pos.shape[0] > 1, k_pos.shape[0] > 1  # static under compile

            def score_mod(score, b, h, q_idx, kv_idx):
                qp = q_pos[h if qh else 0, q_idx]
                kp = k_pos[h if kh else 0, kv_idx]
                return score - slopes[h] * (qp - kp).abs()
        if not lse:
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                        enable_gqa=enable_gqa)
        out, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                        enable_gqa=enable_gqa, **lse_keywords)
        return out, (aux.lse if "return_aux" in lse_keywords else aux)
    return torch.compile(call, dynamic=False) if compiled else call


def _lse_request() -> dict:
    """The keyword asking flex_attention for its log-sum-exp: return_aux=AuxRequest(lse=True)
    where torch has it, else the older return_lse=True."""
    from torch.nn.attention import flex_attention as module

    if hasattr(module, "AuxRequest"):
        return {"return_aux": module.AuxRequest(lse=True)}
    return {"return_lse": True}


def flex_at_positions(q, k, v, block_mask, alibi_slopes, q_pos, k_pos, scale, enable_gqa,
                      return_lse: bool = False):
    """FlexAttention on [b, h, n, d] (not the [s, b, h, d] layout) with tokens at the given
    positions (see `_flex_positions_function`); returns [b, hq, n_q, d], and with return_lse
    also its natural-log log-sum-exp, float32 [b, hq, n_q] (-inf where no key is seen)."""
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
    fn = _flex_positions_function(compiled=q.device.type == "cuda")
    return fn(q, k, v, slopes, q_pos, k_pos, block_mask, scale, enable_gqa, return_lse)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(s_q: int, s_k: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return create_block_mask(causal, B=None, H=None, Q_LEN=s_q, KV_LEN=s_k, device=device)


def _block_mask(s_q, s_k, causal, padding_mask, device):
    """The BlockMask of visible keys: causal, and/or real (unpadded) keys; None for neither."""
    if padding_mask is None:
        return _causal_block_mask(s_q, s_k, device) if causal else None
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        real = padding_mask[b, kv_idx]
        return (q_idx >= kv_idx) & real if causal else real
    return create_block_mask(visible, B=padding_mask.shape[0], H=None, Q_LEN=s_q, KV_LEN=s_k,
                             device=device)


def flex_attention(q, k, v, causal, padding_mask, alibi_slopes, scale):
    """FlexAttention: masks as a BlockMask (skipped blocks), ALiBi as a score_mod."""
    block_mask = _block_mask(q.shape[0], k.shape[0], causal, padding_mask, q.device)
    return flex_with_block_mask(q, k, v, block_mask, alibi_slopes, scale)


def flex_with_block_mask(q, k, v, block_mask, alibi_slopes, scale):
    """FlexAttention on [s, b, h, d] with a caller's BlockMask (None: every key visible)."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
    fn = _flex_function(compiled=q.device.type == "cuda")
    out = fn(qb, kb, vb, slopes, block_mask, scale, q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)  # [s, b, hq, d]


def flash_attention(q, k, v, causal, alibi_slopes, scale, dropout_p):
    """flash-attn 2 (`flash_attn_func`): [b, s, h, d] views, GQA and ALiBi slopes native."""
    from flash_attn import flash_attn_func

    qb, kb, vb = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, h, d]; last dim stays dense
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
    out = flash_attn_func(qb, kb, vb, dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                          alibi_slopes=slopes)
    return out.transpose(0, 1)  # [s, b, hq, d]
