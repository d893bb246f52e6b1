"""Local attention over the heads a rank holds: causal mask, padding mask, scaling, dropout,
ALiBi and grouped-query heads, through one of several backends that compute the same function.

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries (the package's [s, b, ...] layout) |
| k, v | [s, b, hk, d] | keys / values; hq % hk == 0 (GQA: query head i uses kv head i // (hq/hk)) |
| padding_mask | [b, s] bool | True = real token; padded *keys* are masked for every query |
| alibi_slopes | [hq] float32 | slopes of the heads held, by global head index (positions.py) |
| out | [s, b, hq, d] | attention output |

Positions are the indices of the full sequence: callers hand in the whole sequence (Ulysses
and Megatron sequence parallelism gather it before attention). A query that can see no key
(a padded token with only padding before it) gets an output of 0 on every backend.

Backends (`backend=`): "math" (the float32 reference, everywhere), "sdpa" (PyTorch
`scaled_dot_product_attention`; `is_causal=True` when there is no bias so its flash/cuDNN
kernels apply; ALiBi as a materialised [b, h, s, s] bias), "flex" (FlexAttention, compiled on
GPU, ALiBi as a score_mod so no s x s bias exists; see attention_kernels.py) and "flash"
(flash-attn, imported lazily, ALiBi through its `alibi_slopes`). "auto" picks the fastest one
that supports the request: without ALiBi on Hopper or newer, sdpa (cuDNN's fused kernel);
otherwise flash, then flex for ALiBi on CUDA, then sdpa.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import attention_kernels as kernels
from ..parallel.device import compute_capability
from .positions import alibi_bias

BACKENDS = ("auto", "flash", "sdpa", "flex", "math")


@dataclass(frozen=True)
class AttentionRequest:
    """What one call needs, for choosing a backend (no tensors, only facts about them)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    alibi: bool
    padding: bool
    dropout: bool
    requires_grad: bool
    capability: tuple[int, int] = (0, 0)
    """CUDA compute capability of the device ((0, 0) elsewhere)."""


# From Hopper on, SDPA's causal kernel (cuDNN's fused attention) beats flash-attn 2 without ALiBi.
SDPA_FIRST_CAPABILITY = (9, 0)


def unsupported_reason(backend: str, req: AttentionRequest) -> str | None:
    """Why `backend` cannot compute `req` (None when it can). Every backend does GQA."""
    if backend in ("math", "sdpa"):
        return None
    if backend == "flex":
        if not kernels.flex_available():
            return "torch.nn.attention.flex_attention is not available in this torch"
        if req.dropout:
            return "FlexAttention has no attention dropout"
        if req.device_type == "cpu" and req.requires_grad:
            return "FlexAttention has no backward on CPU (torch 2.13); use sdpa or math"
        if req.device_type == "cuda" and req.head_dim < 16:
            return f"FlexAttention's CUDA kernel needs head_dim >= 16, got {req.head_dim}"
        return None
    if backend == "flash":
        if req.device_type != "cuda":
            return "flash-attn runs on CUDA only"
        if req.dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn needs float16 or bfloat16, got {req.dtype}"
        if req.padding:
            return "the flash backend takes no padding mask (it would need unpadded varlen input)"
        if req.head_dim > 256 or req.head_dim % 8 != 0:
            return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {req.head_dim}"
        if not kernels.flash_available():
            return "flash-attn is not installed"
        return None
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def select_backend(requested: str, req: AttentionRequest) -> str:
    """The backend to run: `requested` if it can, else a ValueError; "auto" picks one that can
    (the module docstring's order)."""
    if requested != "auto":
        reason = unsupported_reason(requested, req)
        if reason is not None:
            raise ValueError(f"attention_backend={requested!r} cannot run this call: {reason}; "
                             f"use attention_backend='auto' or another backend")
        return requested
    if req.device_type == "cuda" and not req.alibi and req.capability >= SDPA_FIRST_CAPABILITY:
        return "sdpa"
    candidates = ["flash"] + (["flex"] if req.alibi and req.device_type == "cuda" else [])
    for name in candidates:
        if unsupported_reason(name, req) is None:
            return name
    return "sdpa"


def check_attention_inputs(q, k, v, padding_mask, alibi_slopes, causal) -> None:
    """ValueError unless the shapes fit (module docstring), before any work."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention expects q [s, b, hq, d] and k, v [s, b, hk, d]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (s_q, b, hq, d), (s_k, _, hk, _) = q.shape, k.shape
    if k.shape[1] != b or k.shape[3] != d or hq % hk != 0:
        raise ValueError(f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)}: batch and head "
                         f"dim must match and the query heads ({hq}) be a multiple of kv heads ({hk})")
    if causal and s_q != s_k:
        raise ValueError(f"causal attention here needs as many queries as keys, got {s_q} and {s_k}")
    if padding_mask is not None and (padding_mask.shape != (b, s_k) or padding_mask.dtype != torch.bool):
        raise ValueError(f"padding_mask must be bool [b, s] = [{b}, {s_k}] (True = real token), "
                         f"got {padding_mask.dtype} {tuple(padding_mask.shape)}")
    if alibi_slopes is not None and alibi_slopes.shape != (hq,):
        raise ValueError(f"alibi_slopes must have one slope per query head ([{hq}]), "
                         f"got {tuple(alibi_slopes.shape)}")


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   padding_mask: torch.Tensor | None = None,
                   alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
                   dropout_p: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """softmax(q k^T * scale + alibi, masked) v per head; see the module docstring for shapes.

    scale defaults to 1/sqrt(d). dropout_p applies to the attention probabilities (pass 0.0
    outside training). Raises ValueError for shapes that do not fit or a backend that cannot
    compute the request, before any work.
    """
    check_attention_inputs(q, k, v, padding_mask, alibi_slopes, causal)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    req = AttentionRequest(q.device.type, q.dtype, q.shape[-1], alibi_slopes is not None,
                           padding_mask is not None, dropout_p > 0.0,
                           torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
                           compute_capability(q.device))
    name = select_backend(backend, req)
    if name == "math":
        return math_attention(q, k, v, causal, padding_mask, alibi_slopes, scale, dropout_p)
    if name == "sdpa":
        return sdpa_attention(q, k, v, causal, padding_mask, alibi_slopes, scale, dropout_p)
    if name == "flex":
        return kernels.flex_attention(q, k, v, causal, padding_mask, alibi_slopes, scale)
    return kernels.flash_attention(q, k, v, causal, alibi_slopes, scale, dropout_p)


def visible_keys(s_q: int, s_k: int, causal: bool, padding_mask, device) -> torch.Tensor | None:
    """Bool [b or 1, 1, s_q, s_k]: True where query i may attend key j (None: all may)."""
    allowed = None
    if causal:
        allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril_()[None, None]
    if padding_mask is not None:
        keys = padding_mask[:, None, None, :]  # [b, 1, 1, s_k]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def math_attention(q, k, v, causal, padding_mask, alibi_slopes, scale, dropout_p, mask=None):
    """The reference: explicit float32 scores and softmax, whatever the input dtype.

    mask: an optional further bool mask broadcastable to [b, hq, s_q, s_k] (True = visible),
    ANDed with the causal and padding masks (block-sparse attention's dense check uses it).
    """
    hq, hk = q.shape[2], k.shape[2]
    qf, kf, vf = (t.float().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    if hk != hq:
        kf, vf = (t.repeat_interleave(hq // hk, dim=1) for t in (kf, vf))
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [b, hq, s_q, s_k]
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[0], k.shape[0])
    allowed = visible_keys(q.shape[0], k.shape[0], causal, padding_mask, q.device)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None:  # a query that sees no key outputs 0 (not a uniform average)
        probs = probs * allowed.any(dim=-1, keepdim=True)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, vf)  # [b, hq, s_q, d]
    return out.permute(2, 0, 1, 3).to(q.dtype)


def sdpa_attention(q, k, v, causal, padding_mask, alibi_slopes, scale, dropout_p):
    """PyTorch SDPA; a mask or bias is built only when padding or ALiBi needs one."""
    hq, hk = q.shape[2], k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d], views
    mask, seen = None, None
    if padding_mask is not None or alibi_slopes is not None:
        allowed = visible_keys(q.shape[0], k.shape[0], causal, padding_mask, q.device)
        if allowed is not None:
            # A row with no visible key would be NaN in some kernels: let it see its own
            # position, then zero its output below.
            seen = allowed.any(dim=-1, keepdim=True)  # [b|1, 1, s_q, 1]
            eye = torch.eye(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
            allowed = allowed | (~seen & eye)
        mask = allowed
        if alibi_slopes is not None:
            bias = alibi_bias(alibi_slopes, q.shape[0], k.shape[0], dtype=q.dtype)[None]
            mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
        if hk != hq:  # not every SDPA kernel combines a mask with enable_gqa
            kb, vb = (t.repeat_interleave(hq // hk, dim=1) for t in (kb, vb))
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=mask, dropout_p=dropout_p, scale=scale,
        is_causal=causal and mask is None, enable_gqa=mask is None and hk != hq)
    if seen is not None:
        out = out * seen  # [b|1, 1, s_q, 1] broadcast over heads and d
    return out.permute(2, 0, 1, 3)  # [s, b, hq, d]
