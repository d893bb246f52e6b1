"""How a parameter shard relates to the full (one-process) tensor: metadata on each parameter.

Every parameter of a megazoo layer can carry these attributes (absent means the default):

- `tp_dim: int | None` (None): the dimension of the full tensor split over tensor-parallel
  ranks; None means the parameter is replicated over tp.
- `tp_parts: tuple[int, ...] | None` (None): for fused parameters, the sizes (in the full,
  unpadded tensor) of the blocks concatenated along `tp_dim`. Each block is split over tp on
  its own and a rank keeps its slices of all blocks together, in order; e.g. a fused SwiGLU
  `[gate; up]` of `(ffn, ffn)` rows holds `[gate_r; up_r]` on rank r. None means one block.
- `tp_unpadded: int | None` (None): the real size along `tp_dim` when the sharded tensor is
  padded (the vocabulary); the full tensor is the first `tp_unpadded` rows, the rest padding.
- `tp_index: Callable[[int], LongTensor] | None` (None): for layouts that are neither a
  contiguous split nor fused blocks (the grouped fused QKV of `ParallelAttention`, where
  several tp ranks may hold the same kv head): `tp_index(rank)` gives the indices along
  `tp_dim` of the full tensor that rank holds, in local order; `tp_full_size` is that
  dimension's full size.
- `sequence_parallel: bool` (False): replicated over tp, but its gradient is a partial sum
  under Megatron sequence parallelism (see `mark_sequence_parallel`).
- `tied_to: str | None` (None): the full name of the parameter this one is a copy of (an output
  head on the last pipeline stage tied to the input embedding of the first).

`tp_slice` cuts a rank's shard out of a full tensor and `tp_unslice` rebuilds the full tensor
from every rank's shard; checkpoint resharding and the parallel tests both use them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def set_tp_layout(param: nn.Parameter, dim: int | None, *, parts: tuple[int, ...] | None = None,
                  unpadded: int | None = None, index=None, full_size: int | None = None
                  ) -> nn.Parameter:
    """Record that `param` is split over tp along `dim` (see the module docstring)."""
    if sum(x is not None for x in (parts, unpadded, index)) > 1:
        raise ValueError("give at most one of parts (fused), unpadded (padded), index (gathered)")
    if (index is None) != (full_size is None):
        raise ValueError("index and full_size go together")
    param.tp_dim, param.tp_parts, param.tp_unpadded = dim, (tuple(parts) if parts else None), unpadded
    param.tp_index, param.tp_full_size = index, full_size
    return param


def tp_dim_of(param: torch.Tensor) -> int | None:
    """The dimension split over tp, or None when replicated."""
    return getattr(param, "tp_dim", None)


def _parts(param: torch.Tensor, full_size: int) -> tuple[int, ...]:
    parts = getattr(param, "tp_parts", None)
    return tuple(parts) if parts else (full_size,)


def tp_slice(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard (of a `size`-rank tp group) of the full tensor, shaped like `param`.

    `full` is the one-process tensor without padding (or with any padding: rows past
    `tp_unpadded` are dropped and the shard is zero-padded to `param`'s shape).
    """
    dim = tp_dim_of(param)
    if dim is None:
        return full
    index = getattr(param, "tp_index", None)
    if index is not None:
        return full.index_select(dim, index(rank).to(full.device))
    unpadded = getattr(param, "tp_unpadded", None)
    if unpadded is not None:
        full = full.narrow(dim, 0, min(unpadded, full.shape[dim]))
        pad = param.shape[dim] * size - full.shape[dim]
        spec = [0, 0] * (full.dim() - 1 - dim) + [0, pad]
        full = F.pad(full, spec)
    pieces = []
    for block in full.split(_parts(param, full.shape[dim]), dim):
        if block.shape[dim] % size:
            raise ValueError(f"a block of {block.shape[dim]} along dim {dim} does not divide "
                             f"over tp={size}")
        pieces.append(block.chunk(size, dim)[rank])
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def tp_unslice(shards: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The full tensor (padding removed) from every tp rank's shard, in rank order."""
    dim = tp_dim_of(param)
    if dim is None:
        return shards[0]
    size = len(shards)
    index = getattr(param, "tp_index", None)
    if index is not None:  # replicated rows are written once per holder, with equal values
        shape = list(shards[0].shape)
        shape[dim] = param.tp_full_size
        full = shards[0].new_zeros(shape)
        for rank, shard in enumerate(shards):
            full.index_copy_(dim, index(rank).to(shard.device), shard)
        return full
    parts = _parts(param, shards[0].shape[dim] * size)
    local = [p // size for p in parts]
    per_rank = [s.split(local, dim) for s in shards]
    blocks = [torch.cat([r[i] for r in per_rank], dim) for i in range(len(parts))]
    full = torch.cat(blocks, dim) if len(blocks) > 1 else blocks[0]
    unpadded = getattr(param, "tp_unpadded", None)
    return full if unpadded is None else full.narrow(dim, 0, unpadded)


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the full (unpadded) tensor of which `param` is a shard over `tp_size` ranks."""
    shape = list(param.shape)
    dim = tp_dim_of(param)
    if dim is not None:
        unpadded = getattr(param, "tp_unpadded", None)
        shape[dim] = unpadded if unpadded is not None else shape[dim] * tp_size
        if getattr(param, "tp_index", None) is not None:
            shape[dim] = param.tp_full_size
    return tuple(shape)
