"""Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): attention over a
sequence split across the sp ranks, by trading the sequence split for a head split.

One all-to-all turns the fused q/k/v of a sequence shard (all heads of this tp rank) into the
full sequence of 1/sp of those heads; local attention runs on the full sequence; a second
all-to-all turns the output back into the sequence shard. q, k and v travel together in **one**
all-to-all: the fused QKV projection already lays every kv group out as [q..., k, v] (see
heads.py), so a destination's share is a contiguous slice and needs no stacking copy.

| tensor | shape (on tp rank r, sp rank j) |
|---|---|
| qkv (input) | [s/sp, b, KL (GL + 2) d]: the tp rank's fused QKV output for its sequence shard |
| after the first all-to-all | [s, b, KS (GS + 2) d]: the full sequence of this rank's head block |
| q / k, v | [s, b, HS, d] / [s, b, KS, d], HS = H/(tp sp) query heads |
| context (output) | [s/sp, b, (H/tp) d]: heads in global order, ready for the output projection |
| padding_mask | [b, s] bool, the **full** sequence (True = real token) |
| position_ids | [s] or [b, s], the **full** sequence's global positions (default arange(s)) |

ALiBi slopes are those of the global heads this rank holds (`HeadLayout.first_head`), and RoPE
rotates with global positions, so every layout computes exactly the single-GPU function. With
a block-sparse pattern (`sparse=`), the local attention is `SparseAttention` over the same
global heads, so each rank uses its heads' rows of the one global layout. When
a tp rank holds fewer kv heads than sp, each kv head is sent to every sp rank whose query heads
use it (replicated; its gradients add up through the all-to-all's backward).

**Sequence shards** (`sequence_shard_range`): with Megatron sequence parallelism on as well,
rank (tp r, sp j) holds the contiguous chunk number j*tp + r of s/(tp*sp) tokens, so that the
tp all-gather of the QKV projection yields sp shard j; without it, every tp rank of sp rank j
holds chunk j of s/sp tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.layout import check_sequence_split
from .attention import BACKENDS, core_attention
from .groups import Group, group_rank, group_size
from .heads import HeadLayout
from .mappings import (all_to_all_heads_to_sequence, all_to_all_sequence_to_heads,
                       scatter_to_sequence_parallel_region)
from .positions import alibi_slopes, rope_cos_sin, rope_cos_sin_first
from .qkv_split import split_qkv
from .sparse import SparseAttention

POSITION_EMBEDDINGS = ("none", "alibi", "rope")


def sequence_shard_range(seq_len: int, *, tp_group: Group = None, sp_group: Group = None,
                         megatron_sp: bool = False) -> range:
    """The global positions this rank holds (see the module docstring); without Megatron SP
    (or without a tp group) the rank's Ulysses shard. ValueError if s does not split."""
    tp, sp = group_size(tp_group), group_size(sp_group)
    check_sequence_split(seq_len, tp, sp, megatron_sp)
    tp = tp if megatron_sp else 1
    chunk = seq_len // (tp * sp)
    index = group_rank(sp_group) * tp + (group_rank(tp_group) if megatron_sp else 0)
    return range(index * chunk, (index + 1) * chunk)


def shard_sequence(x: torch.Tensor, *, tp_group: Group = None, sp_group: Group = None,
                   megatron_sp: bool = False) -> torch.Tensor:
    """x_full [s, b, h] (the same on every rank) -> this rank's shard [s/(tp sp) or s/sp, b, h].

    The sp split is a slice (its gradient is completed by the dp x sp gradient reduction); the
    tp split goes through Megatron's scatter region, whose backward all-gathers over tp.
    """
    check_sequence_split(x.shape[0], group_size(tp_group), group_size(sp_group), megatron_sp)
    window = sequence_shard_range(x.shape[0], sp_group=sp_group)
    x_sp = x[window.start:window.stop]  # [s/sp, b, h]
    return scatter_to_sequence_parallel_region(x_sp, tp_group) if megatron_sp else x_sp


def check_global_inputs(seq_len: int, batch: int, padding_mask, position_ids, where: str) -> None:
    """ValueError unless the mask and positions describe the full sequence [b, s]."""
    if padding_mask is not None and (padding_mask.dtype != torch.bool
                                     or tuple(padding_mask.shape) != (batch, seq_len)):
        raise ValueError(f"{where}: padding_mask must be bool [b, s] = [{batch}, {seq_len}] for the "
                         f"full sequence (the local shard times the sequence split), got "
                         f"{padding_mask.dtype} {tuple(padding_mask.shape)}")
    if position_ids is not None and tuple(position_ids.shape) not in ((seq_len,), (batch, seq_len)):
        raise ValueError(f"{where}: position_ids must be [s] or [b, s] for the full sequence "
                         f"(s={seq_len}, b={batch}), got {tuple(position_ids.shape)}")


class UlyssesAttention(nn.Module):
    """All-to-all, local attention over HS = H/(tp sp) heads of the full sequence, all-to-all.

    num_heads and num_kv_heads are the model's (global) counts; the module holds no weights.
    With an sp group of one rank it is plain local attention over the tp rank's heads.
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_kv_heads: int | None = None,
                 sp_group: Group = None, tp_group: Group = None, position_embedding: str = "none",
                 rope_theta: float = 10000.0, causal: bool = True, attention_dropout: float = 0.0,
                 attention_backend: str = "auto", sparse=None):
        super().__init__()
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {POSITION_EMBEDDINGS}, "
                             f"got {position_embedding!r}")
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.layout = HeadLayout(num_heads, num_kv_heads or num_heads, head_dim,
                                 group_size(tp_group), group_size(sp_group))
        self.sp_group, self.position_embedding = sp_group, position_embedding
        self.rope_theta, self.causal = rope_theta, causal
        self.attention_dropout, self.attention_backend = attention_dropout, attention_backend
        self.first_head = self.layout.first_head(group_rank(tp_group), group_rank(sp_group))
        heads = num_heads // (self.layout.tp * self.layout.sp)
        self.head_range = (self.first_head, self.first_head + heads)  # global heads held
        self._send_index = self.layout.ulysses_send_index()  # [sp * f] int64, or None
        self.sparse = None  # or SparseAttention over the global heads this rank holds
        if sparse is not None:
            if attention_dropout > 0:
                raise ValueError(f"attention_dropout {attention_dropout} is not supported with "
                                 f"sparse attention: set it to 0")
            self.sparse = SparseAttention(sparse, num_heads, self.head_range, causal=causal,
                                          backend="math" if attention_backend == "math" else "auto")
        # Per-device caches, not buffers: module.to(bfloat16) must not round the slopes.
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def slopes(self, device) -> torch.Tensor | None:
        """ALiBi slopes of the global heads held, float32 on `device` (None without ALiBi)."""
        if self.position_embedding != "alibi":
            return None
        if ("slopes", device) not in self._on_device:
            full = alibi_slopes(self.layout.num_heads, device=device)
            self._on_device["slopes", device] = full[slice(*self.head_range)]
        return self._on_device["slopes", device]

    def send_index(self, device) -> torch.Tensor | None:
        """Feature indices of the first all-to-all's send buffer when kv heads are replicated."""
        if self._send_index is None:
            return None
        if ("send", device) not in self._on_device:
            self._on_device["send", device] = self._send_index.to(device)
        return self._on_device["send", device]

    def forward(self, qkv: torch.Tensor, padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [s/sp, b, KL (GL+2) d] -> context [s/sp, b, (H/tp) d]; see the module docstring."""
        qkv, s = self.send_buffer(qkv, padding_mask, position_ids)
        qkv = all_to_all_sequence_to_heads(qkv, self.sp_group)  # [s, b, KS (GS+2) d]
        context = self.local(qkv, padding_mask, position_ids)  # [s, b, HS d]
        return all_to_all_heads_to_sequence(context, self.sp_group)  # [s/sp, b, (H/tp) d]

    def local(self, qkv_heads: torch.Tensor, padding_mask=None, position_ids=None) -> torch.Tensor:
        """The attention between the all-to-alls: qkv_heads [s, b, KS (GS+2) d] (the full
        sequence of this rank's kv groups) -> context [s, b, HS d]."""
        rope = self.rope_factors(position_ids, qkv_heads.shape[0], qkv_heads)
        return self.attend(qkv_heads, padding_mask, rope, self.slopes(qkv_heads.device))

    def check_inputs(self, seq_len: int, batch: int, padding_mask, position_ids) -> None:
        """ValueError (before any collective) unless the mask, positions and sparse layout
        fit the full sequence of `seq_len` tokens."""
        check_global_inputs(seq_len, batch, padding_mask, position_ids, type(self).__name__)
        if self.sparse is not None:
            if padding_mask is not None:
                raise ValueError("sparse attention takes no padding_mask: pack the sequences "
                                 "to full length or use dense attention")
            self.sparse.layout(seq_len)  # ValueError (s vs block, global indices)

    def send_buffer(self, qkv: torch.Tensor, padding_mask, position_ids) -> tuple[torch.Tensor, int]:
        """Check the inputs (ValueError, before any collective); return the features to send
        [s/sp, b, sp KS (GS+2) d], destination after destination, and the full length s."""
        lay = self.layout
        if qkv.dim() != 3 or qkv.shape[-1] != lay.qkv_rows_per_rank:
            raise ValueError(f"{type(self).__name__} expects the fused qkv [s/sp, b, "
                             f"{lay.qkv_rows_per_rank}], got {tuple(qkv.shape)}")
        s, b = qkv.shape[0] * lay.sp, qkv.shape[1]
        self.check_inputs(s, b, padding_mask, position_ids)
        send_index = self.send_index(qkv.device)
        if send_index is not None:  # kv heads shared by several sp ranks: send copies
            qkv = qkv.index_select(-1, send_index)
        return qkv, s

    def rope_factors(self, position_ids, seq_len: int, like: torch.Tensor):
        """(cos, sin) [s, 1 or b, d] for the full sequence, or None without RoPE."""
        if self.position_embedding != "rope":
            return None
        if position_ids is None:
            return rope_cos_sin_first(seq_len, self.layout.head_dim, self.rope_theta, like.dtype,
                                      like.device)
        return rope_cos_sin(position_ids, self.layout.head_dim, self.rope_theta, dtype=like.dtype)

    def attend(self, qkv: torch.Tensor, padding_mask, rope, slopes) -> torch.Tensor:
        """Local attention over whole kv groups of the full sequence.

        qkv [s, b, kc (GS+2) d] (kc kv groups of [GS q, k, v] heads, any kc <= KS) ->
        context [s, b, kc GS d]. rope: `rope_factors(...)` or None; slopes: the kc GS heads'
        ALiBi slopes or None.
        """
        gs, d = self.layout.sp_groups[1], self.layout.head_dim
        s, b = qkv.shape[0], qkv.shape[1]
        kc = qkv.shape[-1] // ((gs + 2) * d)
        q, k, v = split_qkv(qkv.view(s, b, kc, gs + 2, d), gs, rope)  # [s, b, heads, d]
        if self.sparse is not None:
            return self.sparse(q, k, v, alibi_slopes=slopes).reshape(s, b, kc * gs * d)
        context = core_attention(q, k, v, causal=self.causal, padding_mask=padding_mask,
                                 alibi_slopes=slopes,
                                 dropout_p=self.attention_dropout if self.training else 0.0,
                                 backend=self.attention_backend)  # [s, b, kc GS, d]
        return context.reshape(s, b, kc * gs * d)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"heads={lay.num_heads}, kv_heads={lay.num_kv_heads}, head_dim={lay.head_dim}, "
                f"tp={lay.tp}, sp={lay.sp}, first_head={self.first_head}, "
                f"position_embedding={self.position_embedding}, backend={self.attention_backend}")
