"""`ContextParallelAttention`: Ulysses inside, the ring across (the hybrid of Megatron-core's
`a2a+p2p` and of USP / yunchang).

The sequence is cut into 2 cp chunks; cp rank r holds chunks r and 2 cp - 1 - r
(`context_parallel_chunks`), and Ulysses and Megatron SP split that pair of chunks as they would
split a whole sequence. After Ulysses' all-to-all a rank holds the cp rank's two chunks for
its head block; ring attention (ring_attention.py) then passes key/value blocks around the cp
ranks holding the same heads; the second all-to-all returns the sequence shard.

| tensor | shape on rank (tp r, sp j, cp c) |
|---|---|
| qkv (input) | [s/(cp sp), b, KL (GL + 2) d], the tp rank's fused QKV of its shard |
| q / k, v in the ring | [s/cp, b, HS, d] / [s/cp, b, KS, d] |
| context (output) | [s/(cp sp), b, (H/tp) d] |
| position_ids | [s] or [b, s], the **full** sequence (default arange(s)); no padding_mask |

RoPE rotates each token by its global position (the positions of the rank's two chunks), and
ALiBi's bias is -slope |i - j| of global positions inside the ring's blocks (math kernel), so
the layer computes the one-process function.
"""
from __future__ import annotations

import functools

import torch

from .groups import Group, group_rank, group_size
from .positions import rope_cos_sin
from .qkv_split import split_qkv
from .ring_attention import context_parallel_positions, ring_attention
from .ring_kernels import BlockKernel, pick_kernel
from .ulysses import UlyssesAttention, check_global_inputs


@functools.lru_cache(maxsize=16)
def _rope_at_chunks(seq_len: int, cp: int, cp_rank: int, head_dim: int, theta: float,
                    dtype: torch.dtype, device: torch.device):
    """RoPE factors [s/cp, 1, d] of a cp rank's default positions, computed once per shape
    (every layer of every step asks for them). Shared tensors: read them only."""
    with torch.inference_mode(False), torch.no_grad():
        positions = context_parallel_positions(seq_len, cp, cp_rank, device)
        return rope_cos_sin(positions, head_dim, theta, dtype=dtype)


class ContextParallelAttention(UlyssesAttention):
    """Ulysses over sp, then causal ring attention over cp (see the module docstring)."""

    def __init__(self, num_heads: int, head_dim: int, *, cp_group: Group, **kwargs):
        super().__init__(num_heads, head_dim, **kwargs)
        cp = group_size(cp_group)
        if self.sparse is not None:
            raise ValueError(f"context parallelism (cp={cp}) does not combine with sparse "
                             f"attention: use dense attention or cp=1")
        if self.attention_dropout > 0 or not self.causal:
            raise ValueError(f"context parallelism (cp={cp}) runs causal attention without "
                             f"dropout: set attention_dropout=0 and causal=True, or cp=1")
        self.cp_group, self.cp = cp_group, cp

    def check_inputs(self, seq_len: int, batch: int, padding_mask, position_ids) -> None:
        """ValueError (before any collective) unless the positions fit the full sequence of
        `seq_len` tokens; no padding mask."""
        if padding_mask is not None:
            raise ValueError("context parallelism takes no padding_mask: pack the sequences "
                             "to full length (labels -100 where nothing is to be learned)")
        check_global_inputs(seq_len, batch, None, position_ids, type(self).__name__)

    def send_buffer(self, qkv: torch.Tensor, padding_mask, position_ids):
        """As Ulysses' (checks first, before any collective), the positions checked against
        the full sequence of s/cp x cp tokens; returns the cp rank's length s/cp."""
        if qkv.dim() == 3:
            self.check_inputs(qkv.shape[0] * self.layout.sp * self.cp, qkv.shape[1],
                              padding_mask, position_ids)
        return super().send_buffer(qkv, None, None)

    def rope_factors(self, position_ids, seq_len: int, like: torch.Tensor):
        """(cos, sin) [s/cp, 1 or b, d] at the global positions of this cp rank's chunks;
        `seq_len` is the cp rank's length s/cp."""
        if self.position_embedding != "rope":
            return None
        rank, full = group_rank(self.cp_group), seq_len * self.cp
        if position_ids is None:
            return _rope_at_chunks(full, self.cp, rank, self.layout.head_dim,
                                   self.rope_theta, like.dtype, like.device)
        mine = context_parallel_positions(full, self.cp, rank, position_ids.device)
        return rope_cos_sin(position_ids[..., mine], self.layout.head_dim, self.rope_theta,
                            dtype=like.dtype)

    def attend(self, qkv: torch.Tensor, padding_mask, rope, slopes) -> torch.Tensor:
        """qkv [s/cp, b, kc (GS+2) d] -> context [s/cp, b, kc GS d] through the ring."""
        gs, d = self.layout.sp_groups[1], self.layout.head_dim
        n, b = qkv.shape[0], qkv.shape[1]
        kc = qkv.shape[-1] // ((gs + 2) * d)
        q, k, v = split_qkv(qkv.view(n, b, kc, gs + 2, d), gs, rope)  # [n, b, heads, d]
        name = pick_kernel(self.attention_backend, q.device, q.dtype, slopes is not None)
        kernel = BlockKernel(name, d ** -0.5, slopes)
        context = ring_attention(q, k, v, self.cp_group, seq_len=n * self.cp, kernel=kernel)
        return context.reshape(n, b, kc * gs * d)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", cp={self.cp}"
