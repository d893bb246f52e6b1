"""TEST-ONLY stand-in for `megazoo.layers.attention.ParallelAttention` (built on the attention
branch). `install()` registers it only when the real module cannot be imported, so the model
tests run before the branches are merged and against the real attention afterwards.

It follows the agreed interface: tp over heads (column q/k/v, row output), Megatron sequence
parallelism through the linear layers, and sp by all-gathering keys/values over the sequence
group (the same function as Ulysses, computed another way). Causal; RoPE, ALiBi or none; GQA.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types

import torch
from torch import nn

from megazoo.layers import ColumnParallelLinear, NormalInit, RowParallelLinear
from megazoo.layers.groups import group_rank, group_size
from megazoo.layers.mappings import gather_from_sequence_parallel_region


def install() -> bool:
    """Register the stand-in as megazoo.layers.attention if that is missing; True if used."""
    try:
        import megazoo.layers.attention  # noqa: F401
        return False
    except ImportError:
        module = types.ModuleType("megazoo.layers.attention")
        module.ParallelAttention = ParallelAttention
        sys.modules["megazoo.layers.attention"] = module
        return True


def _keyed(init, suffix):
    return dataclasses.replace(init, key=init.key + suffix) if isinstance(init, NormalInit) else init


def _rope(x, pos, theta):
    """x [s, b, n, d], pos [s] -> rotated (rotate-half convention)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ParallelAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, *, tp_group=None, sp_group=None, num_kv_heads=None,
                 position_embedding="none", rope_theta=10000.0, bias=True, attention_dropout=0.0,
                 sequence_parallel=False, init_method=None, output_init_method=None,
                 attention_backend="auto", device=None, dtype=None):
        super().__init__()
        tp = group_size(tp_group)
        self.tp_group, self.sp_group, self.pos, self.theta = tp_group, sp_group, position_embedding, rope_theta
        self.heads, self.kv_heads = num_heads, num_kv_heads or num_heads
        self.hd = hidden_size // num_heads
        self.local_heads, self.local_kv = num_heads // tp, self.kv_heads // tp
        self.dropout = attention_dropout
        common = dict(group=tp_group, bias=bias, sequence_parallel=sequence_parallel,
                      device=device, dtype=dtype)
        self.q = ColumnParallelLinear(hidden_size, num_heads * self.hd, init_method=_keyed(init_method, ".q"), **common)
        self.k = ColumnParallelLinear(hidden_size, self.kv_heads * self.hd, init_method=_keyed(init_method, ".k"), **common)
        self.v = ColumnParallelLinear(hidden_size, self.kv_heads * self.hd, init_method=_keyed(init_method, ".v"), **common)
        self.dense = RowParallelLinear(num_heads * self.hd, hidden_size, init_method=output_init_method, **common)

    def forward(self, x, padding_mask=None, position_ids=None):
        s_sp, b = x.shape[0] * (group_size(self.tp_group) if self.q.sequence_parallel else 1), x.shape[1]
        q = self.q(x).view(s_sp, b, self.local_heads, self.hd)
        k = self.k(x).view(s_sp, b, self.local_kv, self.hd)
        v = self.v(x).view(s_sp, b, self.local_kv, self.hd)
        q_pos = group_rank(self.sp_group) * s_sp + torch.arange(s_sp)
        if self.pos == "rope":
            q, k = _rope(q, q_pos, self.theta), _rope(k, q_pos, self.theta)
        k = gather_from_sequence_parallel_region(k, self.sp_group)  # [s, b, kv_l, d]
        v = gather_from_sequence_parallel_region(v, self.sp_group)
        k_pos = torch.arange(k.shape[0])
        rep = self.local_heads // self.local_kv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        scores = torch.einsum("qbnd,kbnd->bnqk", q, k) / math.sqrt(self.hd)
        if self.pos == "alibi":
            first = group_rank(self.tp_group) * self.local_heads
            n = torch.arange(first, first + self.local_heads, dtype=torch.float32) + 1
            slopes = 2.0 ** (-8.0 * n / self.heads)
            scores = scores + slopes[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None])
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.nn.functional.dropout(scores.softmax(-1), self.dropout, self.training)
        out = torch.einsum("bnqk,kbnd->qbnd", probs, v).reshape(s_sp, b, -1)
        return self.dense(out)
