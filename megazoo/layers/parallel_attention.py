"""The tensor- and sequence-parallel self-attention block: fused QKV projection
(ColumnParallelLinear), Ulysses/local attention, output projection (RowParallelLinear).

    y = dense(attention(qkv(x)))

| tensor | shape on rank (tp r, sp j) |
|---|---|
| x, y | [s_local, b, hidden]: s_local = s/sp, or s/(tp sp) with sequence_parallel=True |
| qkv.weight | [KL (GL + 2) d, hidden]: this tp rank's rows of the fused weight (heads.py) |
| dense.weight | [hidden, (H/tp) d]: columns of query heads [r H/tp, (r+1) H/tp) |
| padding_mask | [b, s] bool, full sequence, True = real token (padded keys are masked) |
| position_ids | [s] or [b, s], full sequence, global positions (RoPE only; default arange(s)) |

**Sharding of the sequence.** Megatron sequence parallelism (over tp) and Ulysses (over sp)
compose: rank (tp r, sp j) holds the contiguous chunk j*tp + r of s/(tp sp) tokens (chunk j of
s/sp without Megatron SP); `shard_sequence` / `sequence_shard_range` in ulysses.py give it.
The QKV layer all-gathers over tp (Megatron SP) to sp shard j, Ulysses trades the sequence for
heads over sp, and the output layer reduce-scatters over tp back to chunk j*tp + r.

**Fused QKV weight at tp = 1**: kv group after kv group, `[q heads of the group..., k, v]`,
each head d rows (heads.py has the exact row formula; `qkv_rows(tp_rank)` lists the tp=1
rows a rank holds). With fewer kv heads than tp ranks the kv heads are replicated: each
replica's initial value is the tp=1 head (NormalInit fills every block at its tp=1 rows), and
a gradient hook sums the replicas' gradients over tp, so each copy gets the full tp=1 gradient.

**Gradients the caller reduces** (as for every layer): over dp x sp for all parameters (each sp
rank saw part of the sequence), and `allreduce_sequence_parallel_grads(module, tp)` for the
output bias under Megatron SP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .groups import Group, group_rank, group_size, process_group
from .init import NormalInit, default_init
from .linear import ColumnParallelLinear, RowParallelLinear
from .ulysses import UlyssesAttention, check_global_inputs


class _FusedQKVInit:
    """Fill a tp rank's fused QKV shard block by block at the blocks' tp=1 rows."""

    def __init__(self, init, blocks: list[tuple[int, int]]):
        self.init, self.blocks = init, blocks

    @torch.no_grad()
    def __call__(self, weight: torch.Tensor) -> None:
        if not isinstance(self.init, NormalInit):  # a plain callable sees the local shard
            self.init(weight)
            return
        local = 0
        for first_row, rows in self.blocks:
            self.init.fill_(weight[local:local + rows], first_row, 0)
            local += rows


class SumReplicatedKV:
    """Sum the k/v rows' gradient over the tp ranks holding the same kv head.

    The local shard is [GL q heads, k, v] (one kv group, number `kv_group`); the k/v rows of
    every rank go to slot `kv_group` of a [K, 2d, ...] buffer that is all-reduced over tp.
    A tensor hook on the fused QKV parameters (`__call__`, the whole local gradient); an
    engine that replaces the parameters (FSDP2) finds it as `param.sum_replicated_kv` and
    calls `sum_rows` on its shard of the gradient after backward.
    """

    def __init__(self, group: Group, num_kv_heads: int, kv_group: int, q_rows: int):
        self.group, self.num_kv_heads = group, num_kv_heads
        self.kv_group, self.q_rows = kv_group, q_rows

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        self.sum_rows(grad, 0)
        return grad

    def sum_rows(self, rows: torch.Tensor, start: int) -> None:
        """In place: `rows` are the local rows start, start + 1, ... of the gradient. Every tp
        rank must call it with the same `start` and row count (a collective)."""
        kv = rows[max(self.q_rows - start, 0):]
        slots = kv.new_zeros((self.num_kv_heads,) + tuple(kv.shape))
        slots[self.kv_group] = kv
        dist.all_reduce(slots, group=process_group(self.group))
        kv.copy_(slots[self.kv_group])


class ParallelAttention(nn.Module):
    """Self-attention with tensor parallelism (heads over tp), Megatron sequence parallelism
    and Ulysses (heads over sp). See the module docstring for shapes and layouts.

    tp_group / sp_group: GroupInfo, ProcessGroup or None (one rank); or pass `state`
    (a ParallelState) for both. num_kv_heads < num_heads gives GQA (1: MQA).
    """

    def __init__(self, hidden_size: int, num_heads: int, *, tp_group: Group = None,
                 sp_group: Group = None, state=None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, position_embedding: str = "none",
                 rope_theta: float = 10000.0, bias: bool = True, attention_dropout: float = 0.0,
                 causal: bool = True, sequence_parallel: bool = False, init_method=None,
                 output_init_method=None, attention_backend: str = "auto", device=None, dtype=None):
        super().__init__()
        if state is not None:
            if tp_group is not None or sp_group is not None:
                raise ValueError("ParallelAttention: pass either state or tp_group/sp_group, not both")
            tp_group, sp_group = state.tp, state.sp
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"hidden_size ({hidden_size}) is not divisible by num_heads "
                                 f"({num_heads}): pass head_dim or change the sizes")
            head_dim = hidden_size // num_heads
        self.hidden_size, self.tp_group, self.sequence_parallel = hidden_size, tp_group, sequence_parallel
        tp, tp_rank = group_size(tp_group), group_rank(tp_group)
        self.attention = UlyssesAttention(
            num_heads, head_dim, num_kv_heads=num_kv_heads, sp_group=sp_group, tp_group=tp_group,
            position_embedding=position_embedding, rope_theta=rope_theta, causal=causal,
            attention_dropout=attention_dropout, attention_backend=attention_backend)
        self.layout = layout = self.attention.layout
        factory = {"device": device, "dtype": dtype}
        qkv_init = _FusedQKVInit(init_method or default_init(), layout.qkv_row_blocks(tp_rank))
        self.qkv = ColumnParallelLinear(hidden_size, tp * layout.qkv_rows_per_rank, group=tp_group,
                                        bias=bias, sequence_parallel=sequence_parallel,
                                        init_method=qkv_init, **factory)
        self.dense = RowParallelLinear(num_heads * head_dim, hidden_size, group=tp_group, bias=bias,
                                       sequence_parallel=sequence_parallel,
                                       init_method=output_init_method, **factory)
        if layout.replicated_kv():
            q_rows = layout.tp_groups[1] * head_dim
            kv_group = layout.first_head(tp_rank) // layout.group_size
            for p in self.qkv.parameters():
                p.sum_replicated_kv = SumReplicatedKV(tp_group, layout.num_kv_heads, kv_group,
                                                      q_rows)
                p.register_hook(p.sum_replicated_kv)

    def qkv_rows(self) -> torch.Tensor:
        """The rows of the tp=1 fused QKV weight (and bias) this rank holds, in local order."""
        return self.layout.qkv_rows(group_rank(self.tp_group))

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [s_local, b, hidden] -> y [s_local, b, hidden] (module docstring for the layouts)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ParallelAttention expects x [s_local, b, {self.hidden_size}] "
                             f"(activations [s, b, h]), got {tuple(x.shape)}")
        tp = group_size(self.tp_group) if self.sequence_parallel else 1
        seq_len = x.shape[0] * tp * self.layout.sp
        check_global_inputs(seq_len, x.shape[1], padding_mask, position_ids, "ParallelAttention")
        qkv = self.qkv(x)  # [s/sp, b, KL (GL+2) d]
        context = self.attention(qkv, padding_mask, position_ids)  # [s/sp, b, (H/tp) d]
        return self.dense(context)  # [s_local, b, hidden]

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, sequence_parallel={self.sequence_parallel}"
