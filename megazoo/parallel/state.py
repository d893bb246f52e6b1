"""`ParallelState`: the process groups of one rank, built once from a validated config.

There is no module-global state: build one `ParallelState` and pass it (or the group a layer
needs) explicitly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from .config import ParallelConfig
from .ranks import embedding_groups, rank_groups


@dataclass(frozen=True)
class GroupInfo:
    """One process group as seen from this rank. `group` is None when the group is one rank."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls, global_rank: int = 0) -> "GroupInfo":
        return cls(group=None, ranks=(global_rank,), rank=0)


# The groups a ParallelState builds: name -> dimensions that vary inside the group.
GROUP_DIMS = {
    "tp": ("tp",),
    "sp": ("sp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    # ZeRO / gradient reduction: every rank holding the same shard (the name predates cp:
    # the Ulysses and context-parallel ranks both hold replicas, each seeing its tokens)
    "dp_sp": ("dp", "sp", "cp"),
    "sp_cp": ("sp", "cp"),  # every rank splitting one sequence (DeepSpeed's "sequence parallel")
}


@dataclass(frozen=True)
class ParallelState:
    """Groups and coordinates of this rank. Printed as `TP2-SP2-PP2-DP1 rank 5`."""

    config: ParallelConfig
    global_rank: int
    world_size: int
    tp: GroupInfo
    sp: GroupInfo
    dp: GroupInfo
    pp: GroupInfo
    dp_sp: GroupInfo
    embedding: GroupInfo
    cp: GroupInfo = GroupInfo.single()
    """Context-parallel ring (last, with a default, so older positional builds still fit)."""
    sp_cp: GroupInfo = GroupInfo.single()
    """Ulysses x context-parallel ranks: together they split one sequence."""

    @classmethod
    def single(cls, config: ParallelConfig | None = None) -> "ParallelState":
        """A one-process state: every group has one rank and no collective is issued."""
        config = (config or ParallelConfig()).resolve(1)
        one = GroupInfo.single()
        return cls(config, 0, 1, one, one, one, one, one, one, one, one)

    @classmethod
    def initialize(cls, config: ParallelConfig, backend: str | None = None,
                   timeout=None) -> "ParallelState":
        """Build every group of this rank; initialise torch.distributed from env if needed.
        The config is checked against the world size first, so a misconfigured launch fails on
        every rank with the same message and no collective."""
        if not dist.is_initialized():
            world = int(os.environ.get("WORLD_SIZE", "1"))
            config.resolve(world)  # fail before the rendezvous
            if world == 1 and "MASTER_ADDR" not in os.environ:
                return cls.single(config)
            kwargs = {} if timeout is None else {"timeout": timeout}
            dist.init_process_group(backend=backend, **kwargs)
        world, rank = dist.get_world_size(), dist.get_rank()
        config = config.resolve(world)
        sizes, order = config.sizes(), config.grid_order
        groups = {name: _new_groups(rank_groups(sizes, order, dims), rank)
                  for name, dims in GROUP_DIMS.items()}
        # Middle pipeline stages hold no embedding: a one-rank group of their own.
        embedding = _new_groups(embedding_groups(sizes, order), rank, outside_ok=True)
        return cls(config, rank, world, embedding=embedding, **groups)

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def __str__(self) -> str:
        return f"{self.config} rank {self.global_rank}"


def runs_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether `group` (None: the default process group) exists and runs NCCL for CUDA
    tensors (GPU runs: destroy it at the end). Read from the devices' backends ("nccl",
    "cuda:nccl", "cpu:gloo,cuda:nccl"): a group made without a backend name reports
    "undefined" from `get_backend`. Gloo groups are left standing (`megazoo.cli._leave_gloo`)."""
    return dist.is_initialized() and "nccl" in dist.get_backend_config(group)


def _new_groups(all_groups: list[list[int]], rank: int, outside_ok: bool = False) -> GroupInfo:
    """Create every group (a collective call on all ranks, same order) and keep this rank's;
    a group of one rank gets no process group, a group spanning the world reuses WORLD."""
    mine = None
    world = dist.get_world_size()
    for ranks in all_groups:
        if len(ranks) == 1:
            group = None
        elif len(ranks) == world:
            group = dist.group.WORLD
        else:
            group = dist.new_group(ranks)
        if rank in ranks:
            mine = GroupInfo(group=group, ranks=tuple(ranks), rank=ranks.index(rank))
    if mine is None and outside_ok:
        return GroupInfo.single(rank)
    if mine is None:
        raise RuntimeError(f"rank {rank} is in none of the groups {all_groups}")
    return mine
