"""Parallel-aware transformer layers.

Activation layout, for the whole package: `[s, b, h]` (sequence outermost). Sequence sharding
(Ulysses, Megatron sequence parallelism) splits the first dimension without copies;
tensor parallelism splits the last. Public model entry points take token ids `[b, s]`.

Two sequence splits, never called by each other's name: Ulysses is `sp` (`sp_group`,
`ParallelConfig.sp`, `state.sp`: ranks that trade the sequence for heads in attention);
Megatron's sequence parallelism over the tp ranks is `megatron_sp` where both could be meant
(ParallelConfig, ParallelAttention, the sequence-shard helpers) and keeps Megatron's own name,
`sequence_parallel=`, on the Megatron-style layers that only know that one (linear layers,
norms, MLP, the `sequence_parallel` tag of parameters) and in the `--sequence-parallel` flag.
"""
from .attention import BACKENDS, core_attention, select_backend, unsupported_reason
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, padded_vocab_size
from .fused_linear import FusedColumnParallelLinear
from .heads import HeadLayout
from .init import NormalInit
from .linear import (ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads,
                     mark_sequence_parallel)
from .mappings import (all_to_all_heads_to_sequence, all_to_all_sequence_to_heads,
                       copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, gather_sequence_replicated,
                       reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm
from .parallel_attention import AttentionConfig, ParallelAttention
from .positions import alibi_bias, alibi_slopes, apply_rope, rope_cos_sin, rotate_half
from .sharding import set_tp_layout, tp_slice, tp_unslice
from .ulysses import UlyssesAttention, sequence_shard_range, shard_sequence

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "padded_vocab_size", "NormalInit",
    "allreduce_sequence_parallel_grads", "mark_sequence_parallel",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_sequence_replicated",
    "all_to_all_sequence_to_heads", "all_to_all_heads_to_sequence",
    "core_attention", "select_backend", "unsupported_reason", "BACKENDS",
    "alibi_slopes", "alibi_bias", "rope_cos_sin", "apply_rope", "rotate_half",
    "HeadLayout", "UlyssesAttention", "ParallelAttention", "sequence_shard_range", "shard_sequence",
    "FusedColumnParallelLinear", "LayerNorm", "RMSNorm", "ParallelMLP", "AttentionConfig",
    "set_tp_layout", "tp_slice", "tp_unslice",
]
