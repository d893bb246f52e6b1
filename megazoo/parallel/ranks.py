"""Pure rank arithmetic: which global ranks form each process group. No processes needed.

The world is a 5-D grid. `order` lists the dimensions innermost first, so with the default
order ("tp", "sp", "cp", "dp", "pp") the global rank is

    rank = tp_rank + tp * (sp_rank + sp * (cp_rank + cp * (dp_rank + dp * pp_rank)))

and tensor-parallel ranks are adjacent (they stay inside a node), Ulysses' all-to-all next,
then the context-parallel ring (point-to-point, the least bandwidth per byte of activation).
Worked example, tp=2, sp=1, cp=1, dp=2, pp=2 (8 ranks):

    tp groups: [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups: [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups: [0, 4] [1, 5] [2, 6] [3, 7]
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch


def rank_groups(sizes: dict[str, int], order: Sequence[str], dims: Iterable[str]) -> list[list[int]]:
    """All groups of ranks that differ only along `dims` (every other coordinate fixed).

    A group lists its ranks in increasing order; groups are listed in increasing order of their
    first rank. `rank_groups(s, o, ["dp", "sp"])` is the ZeRO gradient-reduction group dp x sp.
    """
    dims = set(dims)
    unknown = dims - set(order)
    if unknown:
        raise ValueError(f"unknown dimensions {sorted(unknown)}; expected some of {list(order)}")
    outer_first = list(reversed(order))
    shape = [sizes[d] for d in outer_first]
    grid = torch.arange(math.prod(shape)).view(*shape)  # the world's ranks, outermost dim first
    fixed = [i for i, d in enumerate(outer_first) if d not in dims]
    varying = [i for i, d in enumerate(outer_first) if d in dims]
    group_size = math.prod(sizes[outer_first[i]] for i in varying)
    rows = grid.permute(*fixed, *varying).reshape(-1, group_size)
    return sorted(sorted(row.tolist()) for row in rows)


def coordinates(rank: int, sizes: dict[str, int], order: Sequence[str]) -> dict[str, int]:
    """The coordinates (one per dimension of `order`) of a global rank."""
    world = math.prod(sizes.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks")
    coords = {}
    for d in order:
        coords[d] = rank % sizes[d]
        rank //= sizes[d]
    return coords


def embedding_groups(sizes: dict[str, int], order: Sequence[str]) -> list[list[int]]:
    """For each pipeline group, its first and last stage (one rank when pp == 1).

    These ranks hold the input embedding and the output head; tied weights are all-reduced
    between them. A rank grows with its pp coordinate, so a sorted group lists its stages in
    order.
    """
    return [sorted({pipe[0], pipe[-1]}) for pipe in rank_groups(sizes, order, ["pp"])]
