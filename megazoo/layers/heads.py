"""Which attention heads, and which rows of the fused QKV weight, each rank holds. Pure
arithmetic, no processes: tested on its own.

**Fused QKV layout at tp = 1** (the layout the Hugging Face converters map to). With H query
heads, K kv heads, G = H / K query heads per kv head and head dim d, the weight
`[(H + 2K) d, hidden]` (and the bias) is K blocks, one per kv group g = 0..K-1, each

    [ q head gG, q head gG+1, ..., q head gG+G-1, k head g, v head g ]   (d rows each)

so rows `g(G+2)d + j d .. + d` are q head gG+j, rows `g(G+2)d + G d ..` k head g and rows
`g(G+2)d + (G+1)d ..` v head g. Multi-head attention (K = H) is per head `[q, k, v]`, which is
BLOOM's `query_key_value` as stored; LLaMA's q_proj / k_proj / v_proj interleave into it.

**Tensor parallelism** splits kv groups: with K % tp == 0, rank r holds groups
[r K/tp, (r+1) K/tp), a contiguous block of rows. With tp % K == 0 (fewer kv heads than ranks)
the kv heads are **replicated**: the tp/K ranks sharing group g each hold H/tp of its query
heads and a full copy of k head g and v head g. Either way a rank's local fused layout is again
"groups of [q..., k, v]": KL groups of GL query heads each.

**Ulysses** (sp) then splits the rank's query heads the same way: with KL % sp == 0 each sp rank
gets KL/sp whole groups (a contiguous slice of the local features); with sp % KL == 0 the sp
ranks sharing a group each get GL KL / sp of its query heads and a copy of its k and v.
Query heads keep their global order throughout: tp rank r, sp rank j holds global query heads
[r H/tp + j H/(tp sp), ... + H/(tp sp)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.layout import check_heads, split_groups


@dataclass(frozen=True)
class HeadLayout:
    """Head counts of one tp x sp layout. Validated on construction (a ValueError, no collective)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        check_heads(self.num_heads, self.num_kv_heads, self.head_dim, self.tp, self.sp)

    @property
    def group_size(self) -> int:
        """G: query heads per kv head in the full model."""
        return self.num_heads // self.num_kv_heads

    @property
    def tp_groups(self) -> tuple[int, int]:
        """(kv groups, query heads per group) on one tp rank (KL, GL)."""
        return split_groups(self.num_kv_heads, self.group_size, self.tp, "")

    @property
    def sp_groups(self) -> tuple[int, int]:
        """(kv groups, query heads per group) after the Ulysses split (on one tp x sp rank)."""
        kl, gl = self.tp_groups
        return split_groups(kl, gl, self.sp, "")

    @property
    def qkv_rows_per_rank(self) -> int:
        """Rows of the fused QKV weight on one tp rank: KL (GL + 2) d."""
        kl, gl = self.tp_groups
        return kl * (gl + 2) * self.head_dim

    @property
    def qkv_rows_full(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def first_head(self, tp_rank: int, sp_rank: int = 0) -> int:
        """Global index of the first query head held by (tp_rank, sp_rank)."""
        per_tp = self.num_heads // self.tp
        return tp_rank * per_tp + sp_rank * (per_tp // self.sp)

    def qkv_row_blocks(self, tp_rank: int) -> list[tuple[int, int]]:
        """(first row in the tp=1 fused weight, number of rows) of each local block, in order."""
        d, g_full = self.head_dim, self.group_size
        kl, gl = self.tp_groups
        blocks = []
        for local in range(kl):
            first_q = self.first_head(tp_rank) + local * gl  # global query head index
            group = first_q // g_full
            base = group * (g_full + 2) * d
            blocks += [(base + (first_q % g_full) * d, gl * d), (base + g_full * d, 2 * d)]
        return blocks

    def qkv_rows(self, tp_rank: int) -> torch.Tensor:
        """Indices of the tp=1 fused weight rows held by `tp_rank`, in local order (int64)."""
        return torch.cat([torch.arange(start, start + n) for start, n in self.qkv_row_blocks(tp_rank)])

    def replicated_kv(self) -> bool:
        """Whether several tp ranks hold the same kv head (K < tp)."""
        return self.num_kv_heads < self.tp

    def ulysses_send_index(self) -> torch.Tensor | None:
        """Local feature indices to send, destination by destination (None: plain slices).

        The local features are KL groups of [GL q, k, v] x d. Destination sp rank j receives
        its groups of [GS q, k, v] x d; when sp % KL == 0 k and v are sent to several ranks.
        """
        kl, gl = self.tp_groups
        ks, gs = self.sp_groups
        if ks * self.sp == kl:
            return None
        d, per_group = self.head_dim, (gl + 2) * self.head_dim
        index = []
        for j in range(self.sp):
            group, sub = divmod(j * gs, gl)  # local group and first query head within it
            base = group * per_group
            index += [torch.arange(base + sub * d, base + (sub + gs) * d),
                      torch.arange(base + gl * d, base + per_group)]
        return torch.cat(index)
