"""The tensor- and sequence-parallel self-attention block: fused QKV projection
(ColumnParallelLinear), Ulysses/local attention, output projection (RowParallelLinear).

    layer = ParallelAttention(AttentionConfig(hidden_size=1024, num_heads=16, num_kv_heads=4,
                                              position_embedding="rope"),
                              tp_group=state.tp, sp_group=state.sp, megatron_sp=True)
    y = dense(attention(qkv(x)))

`AttentionConfig` says what the layer computes; the constructor adds where it runs, how its
weights start, and whether its parameter-free core (RoPE, the all-to-alls, softmax(QK^T)V)
is recomputed in backward (`recompute_core`).

| tensor | shape on rank (tp r, sp j) |
|---|---|
| x, y | [s_local, b, hidden]: s_local = s/sp, or s/(tp sp) with megatron_sp=True |
| qkv.weight | [KL (GL + 2) d, hidden]: this tp rank's rows of the fused weight (heads.py) |
| dense.weight | [hidden, (H/tp) d]: columns of query heads [r H/tp, (r+1) H/tp) |
| padding_mask | [b, s] bool, full sequence, True = real token (padded keys are masked) |
| position_ids | [s] or [b, s], full sequence, global positions (RoPE only; default arange(s)) |

The sequence shards are those of `sequence_shard_range` (ulysses.py): the QKV layer
all-gathers over tp (Megatron SP), Ulysses trades the sequence for heads over sp, and the
output layer reduce-scatters over tp. The fused QKV rows are laid out as heads.py says. With
fewer kv heads than tp ranks the kv heads are replicated: each replica starts as the tp=1
head, and a gradient hook sums the replicas' gradients over tp (`SumReplicatedKV`).

**Gradients the caller reduces** (as for every layer): over dp x sp for all parameters (each sp
rank saw part of the sequence), and `allreduce_sequence_parallel_grads(module, tp)` for the
output bias under Megatron SP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config.sparse_attention import SparseAttentionConfig
from .groups import Group, group_rank, group_size, process_group
from .init import NormalInit, default_init
from .linear import ColumnParallelLinear, RowParallelLinear
from .sharding import set_tp_layout
from .tp_overlap import usable_chunks
from .ulysses import UlyssesAttention, check_global_inputs
from .ulysses_overlap import project_from_heads, project_to_heads


@dataclass(frozen=True)
class AttentionConfig:
    """What one self-attention layer computes; validated by ParallelAttention."""

    hidden_size: int
    """Width of the layer's input and output."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int | None = None
    """Key/value heads (fewer than num_heads: GQA, 1: MQA); None: num_heads."""
    head_dim: int | None = None
    """Width of one head; None: hidden_size / num_heads."""
    position_embedding: str = "none"
    """Positions applied inside attention: "none", "rope" or "alibi"."""
    rope_theta: float = 10000.0
    """RoPE base."""
    qkv_bias: bool = True
    """A bias on the fused QKV projection."""
    dense_bias: bool = True
    """A bias on the output projection."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (training only)."""
    causal: bool = True
    """Causal (decoder) masking."""
    attention_backend: str = "auto"
    """Local attention kernel (layers/attention.py); "auto" picks the best available."""
    sparse: SparseAttentionConfig | None = None
    """Block-sparse attention pattern (layers/sparse/); None: dense."""

    @property
    def resolved_head_dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                             f"({self.num_heads}): pass head_dim or change the sizes")
        return self.hidden_size // self.num_heads


class _FusedQKVInit:
    """Fill a tp rank's fused QKV shard block by block at the blocks' tp=1 rows."""

    def __init__(self, init, blocks: list[tuple[int, int]]):
        self.init, self.blocks = init, blocks

    def __call__(self, weight: torch.Tensor) -> None:  # under no_grad (`init_shard_`)
        if not isinstance(self.init, NormalInit):  # a plain callable sees the local shard
            self.init(weight)
            return
        blocks = weight.split([rows for _, rows in self.blocks])
        for block, (first_row, _) in zip(blocks, self.blocks):
            self.init.fill_(block, first_row, 0)


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
    and Ulysses (heads over sp). See the module docstring for shapes and layouts; groups:
    GroupInfo, ProcessGroup or None (one rank)."""

    def __init__(self, config: AttentionConfig, *, tp_group: Group = None, sp_group: Group = None,
                 megatron_sp: bool = False, init_method=None, output_init_method=None,
                 recompute_core: bool = False, device=None, dtype=None, fp8=None):
        super().__init__()
        head_dim = config.resolved_head_dim
        self.config, self.hidden_size, self.tp_group = config, config.hidden_size, tp_group
        self.megatron_sp, self.recompute_core = megatron_sp, recompute_core
        tp, tp_rank = group_size(tp_group), group_rank(tp_group)
        self.attention = UlyssesAttention(
            config.num_heads, head_dim, num_kv_heads=config.num_kv_heads, sp_group=sp_group,
            tp_group=tp_group, position_embedding=config.position_embedding,
            rope_theta=config.rope_theta, causal=config.causal,
            attention_dropout=config.attention_dropout, attention_backend=config.attention_backend,
            sparse=config.sparse)
        self.layout = layout = self.attention.layout
        factory = {"device": device, "dtype": dtype, "fp8": fp8}  # fp8: qkv and dense GEMMs
        qkv_init = _FusedQKVInit(init_method or default_init(), layout.qkv_row_blocks(tp_rank))
        self.qkv = ColumnParallelLinear(config.hidden_size, tp * layout.qkv_rows_per_rank,
                                        group=tp_group, bias=config.qkv_bias,
                                        sequence_parallel=megatron_sp, init_method=qkv_init,
                                        **factory)
        self.dense = RowParallelLinear(config.num_heads * head_dim, config.hidden_size,
                                       group=tp_group, bias=config.dense_bias,
                                       sequence_parallel=megatron_sp,
                                       init_method=output_init_method, **factory)
        self.ulysses_chunks = 1  # `set_ulysses_overlap`
        for p in self.qkv.parameters():  # which tp=1 rows of the fused QKV this rank holds
            set_tp_layout(p, 0, index=layout.qkv_rows, full_size=layout.qkv_rows_full)
        if layout.replicated_kv():
            q_rows = layout.tp_groups[1] * head_dim
            kv_group = layout.first_head(tp_rank) // layout.group_size
            for p in self.qkv.parameters():
                p.sum_replicated_kv = SumReplicatedKV(tp_group, layout.num_kv_heads, kv_group,
                                                      q_rows)
                p.register_hook(p.sum_replicated_kv)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [s_local, b, hidden] -> y [s_local, b, hidden] (module docstring for the layouts)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ParallelAttention expects x [s_local, b, {self.hidden_size}] "
                             f"(activations [s, b, h]), got {tuple(x.shape)}")
        tp = group_size(self.tp_group) if self.megatron_sp else 1
        seq_len = x.shape[0] * tp * self.layout.sp
        check_global_inputs(seq_len, x.shape[1], padding_mask, position_ids, "ParallelAttention")
        if self.projected_ulysses(x):
            return self._forward_projected(x, padding_mask, position_ids, seq_len)
        qkv = self.qkv(x)  # [s/sp, b, KL (GL+2) d]
        if self.recompute_core and torch.is_grad_enabled():  # keep qkv, rerun the core
            context = checkpoint(self.attention, qkv, padding_mask, position_ids,
                                 use_reentrant=False)
        else:
            context = self.attention(qkv, padding_mask, position_ids)  # [s/sp, b, (H/tp) d]
        return self.dense(context)  # [s_local, b, hidden]

    def projected_ulysses(self, x: torch.Tensor) -> bool:
        """Whether Ulysses' all-to-alls run inside the projections (`ulysses_overlap.py`):
        sp > 1, each destination's kv groups a plain slice of the fused rows (no kv copies),
        the run's dtype (no FP8 GEMMs, no autocast)."""
        return (self.layout.sp > 1 and self.layout.ulysses_send_index() is None
                and self.qkv.fp8 is None and self.dense.fp8 is None
                and not torch.is_autocast_enabled(x.device.type))

    def _forward_projected(self, x, padding_mask, position_ids, seq_len: int) -> torch.Tensor:
        """QKV projection + all-to-all, attention, all-to-all + output projection, the
        all-to-alls chunked by kv groups and overlapped with the projections."""
        self.attention.check_inputs(seq_len, x.shape[1], padding_mask, position_ids)
        k = usable_chunks(self.layout.sp_groups[0], self.ulysses_chunks)
        sp_group = self.attention.sp_group
        qkv_heads = project_to_heads(self.qkv.gather_input(x), self.qkv.weight, self.qkv.bias,
                                     sp_group, k)  # [s, b, KS (GS+2) d]
        if self.recompute_core and torch.is_grad_enabled():  # keep qkv_heads, rerun the core
            context = checkpoint(self.attention.local, qkv_heads, padding_mask, position_ids,
                                 use_reentrant=False)
        else:
            context = self.attention.local(qkv_heads, padding_mask, position_ids)  # [s, b, HS d]
        y = self.dense.reduce(project_from_heads(context, self.dense.weight, sp_group, k))
        if group_size(self.tp_group) == 1 and self.dense.bias is not None:
            y = y + self.dense.bias  # (at tp > 1 `reduce` adds it after the reduction)
        return y  # [s_local, b, hidden]

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, megatron_sp={self.megatron_sp}, "
                f"recompute_core={self.recompute_core}")


def set_ulysses_overlap(model: nn.Module, chunks: int) -> int:
    """Set every ParallelAttention's `ulysses_chunks` (up to `chunks` per all-to-all, whole kv
    groups each; 1: one all-to-all each way, the default); returns how many were set."""
    if chunks < 1:
        raise ValueError(f"Ulysses overlap chunks must be at least 1, got {chunks}")
    layers = [m for m in model.modules() if isinstance(m, ParallelAttention)]
    for layer in layers:
        layer.ulysses_chunks = chunks
    return len(layers)
