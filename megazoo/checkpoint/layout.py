"""A checkpoint's layout, without processes: which (pp, tp) rank writes which file, and each
rank's parameters (names, local shapes, shard metadata) from a model built on the meta device.

`virtual_state(tp, pp, vpp, tp_rank, pp_rank)` is a `ParallelState` whose groups carry the
right sizes and ranks but no process group (`group=None`). Layers issue no collective at
construction, so `rank_model` builds any rank of any layout in one process, allocating nothing;
its parameters carry `tp_dim` / `tp_parts` / `tp_index` / `tp_unpadded`, which drive
`tp_slice` (writing a rank's shard) and `tp_unslice` (rebuilding a full tensor).
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers.sharding import full_shape
from ..models import ModelConfig, build_model, full_name
from ..parallel.config import ParallelConfig
from ..parallel.ranks import embedding_groups, rank_groups
from ..parallel.state import GROUP_DIMS, GroupInfo, ParallelState

FORMAT = "megazoo-checkpoint-1"
METADATA_FILE = "megazoo.json"


def rank_file(pp_rank: int, tp_rank: int) -> str:
    """The file written by pipeline rank `pp_rank`, tensor rank `tp_rank`."""
    return f"model-pp{pp_rank:03d}-tp{tp_rank:03d}.safetensors"


def _group(groups: list[list[int]], rank: int) -> GroupInfo:
    for ranks in groups:
        if rank in ranks:
            return GroupInfo(group=None, ranks=tuple(ranks), rank=ranks.index(rank))
    return GroupInfo.single(rank)  # a middle stage is in no embedding group


def virtual_state(tp: int, pp: int, vpp: int, tp_rank: int, pp_rank: int) -> ParallelState:
    """The state of rank (pp_rank, tp_rank) of a tp x pp world (sp = dp = 1), with no process
    groups: for building models on the meta device only (never call forward with it)."""
    config = ParallelConfig(tp=tp, pp=pp, vpp=vpp).resolve(tp * pp)  # validates the sizes
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise ValueError(f"rank (pp {pp_rank}, tp {tp_rank}) is outside a pp={pp} x tp={tp} layout")
    sizes, order = config.sizes(), config.grid_order
    rank = tp_rank + tp * pp_rank  # default order: tp innermost, then sp, dp (size 1), pp
    groups = {name: _group(rank_groups(sizes, order, dims), rank) for name, dims in GROUP_DIMS.items()}
    embedding = _group(embedding_groups(sizes, order), rank)
    return ParallelState(config, rank, tp * pp, embedding=embedding, **groups)


def rank_model(config: ModelConfig, layout: dict, pp_rank: int, tp_rank: int) -> nn.Module:
    """Rank (pp_rank, tp_rank)'s model of `layout` on the meta device (names, shapes, metadata)."""
    state = virtual_state(layout["tp"], layout["pp"], layout["vpp"], tp_rank, pp_rank)
    return build_model(config, state, device="meta")


def stored_parameters(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """{full name: (local name, parameter)} of the parameters a rank file stores: every
    parameter except a tied head copy (stored once, as the embedding)."""
    return {full_name(name, p): (name, p) for name, p in model.named_parameters()
            if not getattr(p, "tied_to", None)}


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{full name: full (unpadded) shape} of every stored parameter of the model."""
    model = build_model(config, None, device="meta")
    return {name: full_shape(p, 1) for name, (_, p) in stored_parameters(model).items()}
