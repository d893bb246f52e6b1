"""Position information inside attention: ALiBi (BLOOM) slopes and biases, rotary embeddings
(RoPE, in the convention of Hugging Face LLaMA).

Both take **global** quantities: ALiBi slopes are indexed by the global head number (a rank
holding heads 8..11 of 16 asks for `alibi_slopes(16)[8:12]`), and RoPE angles by the global
position of each token (its sequence shard's offset plus its local index).

| name | shape | meaning |
|---|---|---|
| slopes | [heads] float32 | ALiBi slope of each head |
| alibi bias | [heads, s_q, s_k] | -slope * abs(i - j): 0 on the diagonal, more negative further back |
| position_ids | [s] or [b, s] int | global position of each token |
| cos, sin | [s, b or 1, d] | rotary factors, each half of d repeated (HF's `cat((freqs, freqs))`) |
"""
from __future__ import annotations

import functools
import math

import torch

from ..kernels.fusion import rope_pair, rotate_half  # noqa: F401 (re-exported)


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The ALiBi slope of every head, as BLOOM defines them (float32, [num_heads]).

    For n a power of two the slopes are 2^(-8k/n), k = 1..n. Otherwise the first
    p = 2^floor(log2 n) heads take the slopes of p heads, and the remaining n - p heads take
    every other slope of 2p heads (2^(-8k/2p) for k = 1, 3, 5, ...), as in Press et al. and
    `transformers`' BLOOM. Computed in float64, rounded once to float32.
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes needs at least one head, got num_heads={num_heads}")
    p = 2 ** int(math.floor(math.log2(num_heads)))
    exponents = [8.0 * k / p for k in range(1, p + 1)]
    exponents += [8.0 * k / (2 * p) for k in range(1, 2 * (num_heads - p), 2)]
    slopes = torch.tensor([2.0 ** -e for e in exponents], dtype=torch.float64)
    return slopes.to(device=device, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, s_q: int, s_k: int, dtype=torch.float32) -> torch.Tensor:
    """The additive ALiBi bias -slope * |i - j| for queries i < s_q and keys j < s_k.

    slopes [h] -> bias [h, s_q, s_k]. Under a causal mask this equals BLOOM's `slope * j` up to
    a constant per query row, which softmax ignores; it is also what flash-attn computes from
    `alibi_slopes`. Both index ranges are positions in the full (global) sequence.
    """
    i = torch.arange(s_q, device=slopes.device, dtype=torch.float32)[:, None]
    j = torch.arange(s_k, device=slopes.device, dtype=torch.float32)[None, :]
    distance = (i - j).abs_()  # [s_q, s_k]
    return (-slopes.float()[:, None, None] * distance).to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float = 10000.0,
                 dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary factors for global positions, laid out sequence first.

    position_ids [s] or [b, s] -> cos, sin [s, 1, d] or [s, b, d] (in `dtype`). Angles are
    computed in float32 and rounded to `dtype` afterwards, as `LlamaRotaryEmbedding` does.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got head_dim={head_dim}")
    if position_ids.dim() == 1:
        position_ids = position_ids[None, :]
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)  # theta^(-2i/d): LLaMA's rotary frequencies, [d/2]
    freqs = position_ids.float()[..., None] * inv_freq  # [b, s, d/2]
    angles = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)  # [s, b, d]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_rope_factors(caller: str, cos: torch.Tensor, x: torch.Tensor) -> None:
    """ValueError unless cos (and sin, same shape) [s, b or 1, d] fit x [s, b, ..., d]."""
    s, b, d = x.shape[0], x.shape[1], x.shape[-1]
    if cos.shape[0] != s or cos.shape[1] not in (1, b) or cos.shape[-1] != d:
        raise ValueError(f"{caller}: cos/sin {tuple(cos.shape)} do not match {tuple(x.shape)} "
                         f"(expected [s, b or 1, d] with s={s}, b={b}, d={d})")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k [s, b, *heads, d] by cos, sin [s, b or 1, d] (HF LLaMA convention):
    x * cos + rotate_half(x) * sin, with rotate_half([x1, x2]) = [-x2, x1]."""
    for x in (q, k):
        check_rope_factors("apply_rope", cos, x)
    view = (cos.shape[0], cos.shape[1]) + (1,) * (q.dim() - 3) + (cos.shape[-1],)
    return rope_pair(q, k, cos.view(view), sin.view(view))


@functools.lru_cache(maxsize=16)
def rope_cos_sin_first(seq_len: int, head_dim: int, theta: float, dtype: torch.dtype,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` of positions 0 .. seq_len - 1 ([s, 1, d]), computed once per shape: every
    layer of every step asks for the same factors, and their half dozen small kernels would
    otherwise run (and be launched) each time. The tensors are shared: read them only."""
    with torch.inference_mode(False), torch.no_grad():
        return rope_cos_sin(torch.arange(seq_len, device=device), head_dim, theta, dtype=dtype)
