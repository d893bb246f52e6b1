"""Accept a group as a `GroupInfo`, a `torch.distributed.ProcessGroup` or None.

None always means "one rank, no communication" (unlike torch.distributed, where it means WORLD).
"""
from __future__ import annotations

import torch.distributed as dist

from ..parallel.state import GroupInfo

Group = GroupInfo | dist.ProcessGroup | None


def process_group(group: Group) -> dist.ProcessGroup | None:
    """The torch process group to pass to collectives (None for a one-rank group)."""
    if isinstance(group, GroupInfo):
        return group.group
    return group


def group_size(group: Group) -> int:
    if isinstance(group, GroupInfo):
        return group.size
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    if isinstance(group, GroupInfo):
        return group.rank
    if group is None:
        return 0
    return dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator // denominator, or a ValueError naming what does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}; "
                         f"choose sizes so that it divides")
    return numerator // denominator
