"""Parallel-aware transformer layers.

Activation layout, for the whole package: `[s, b, h]` (sequence outermost). Sequence sharding
(Ulysses, Megatron sequence parallelism) splits the first dimension without copies;
tensor parallelism splits the last. Public model entry points take token ids `[b, s]`.
"""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, padded_vocab_size
from .block import TransformerBlock
from .fused_linear import FusedColumnParallelLinear
from .init import NormalInit
from .linear import (ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads,
                     mark_sequence_parallel)
from .mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       gather_sequence_replicated,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm
from .sharding import set_tp_layout, tp_slice, tp_unslice

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "padded_vocab_size", "NormalInit",
    "allreduce_sequence_parallel_grads", "mark_sequence_parallel",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "gather_sequence_replicated",
    "FusedColumnParallelLinear", "LayerNorm", "RMSNorm", "ParallelMLP", "TransformerBlock",
    "set_tp_layout", "tp_slice", "tp_unslice",
]
