"""Pieces of `FSDP2Engine`: the mesh, the sharding of a stage, gradient sync per chunk.

Sharding. Each run of `blocks_per_unit` (--fsdp-blocks-per-unit, 2 by default) consecutive
transformer blocks of a chunk is one FSDP2 unit (the last one of a chunk may be shorter; a
unit never spans chunks, which run at different times of the schedule), and the stage object
itself (embedding, final norm, head) the root unit, all over one 1-D mesh made of our
`dp_sp` group: every rank that holds the same tp shard of the same pipeline stage. FSDP2
shards each parameter along dim 0 over that mesh; tp shards stay shards.

Gradient scaling. FSDP2's reduce-scatter averages over the mesh (dp x sp); the rest of the
contract ("sum over sp, mean over dp", Megatron-SP tp sums, GQA kv rows, tied embeddings)
is `megazoo.training.gradients.complete_sharded_gradients` on the local shards (FSDP2's
`set_gradient_divide_factor(dp)` would fold the sp factor into the reduce-scatter, but it
needs ReduceOp.PREMUL_SUM, which gloo lacks).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...config.zero import ZeroConfig
from ...parallel.state import ParallelState


def one_rank_groups(state: ParallelState):
    """A process group holding only this rank (collective: every rank creates every one)."""
    mine = None
    for rank in range(state.world_size):
        group = dist.new_group([rank])
        if rank == state.global_rank:
            mine = group
    return mine


def shard_mesh(state: ParallelState, device: torch.device):
    """The 1-D device mesh over `state.dp_sp` (a one-rank group when dp x sp = 1)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise ValueError("FSDP2 needs torch.distributed initialised: launch with torchrun "
                         "(or ParallelState.initialize under MASTER_ADDR / WORLD_SIZE)")
    group = state.dp_sp.group if state.dp_sp.group is not None else one_rank_groups(state)
    return DeviceMesh.from_group(group, device.type)


def shard_stage(model: nn.Module, mesh, *, device: torch.device, bf16: bool,
                cpu_offload: bool, reshard_after_forward: bool,
                reduce_dtype: torch.dtype | None = None,
                blocks_per_unit: int = ZeroConfig.fsdp_blocks_per_unit) -> None:
    """fully_shard the blocks (`unit_blocks`), then the stage root (in place; see the module
    docstring).
    `reduce_dtype` (communication_data_type): the dtype of the gradient reduce-scatter
    (default fp32 under bf16, else the parameters')."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=reduce_dtype or (torch.float32 if bf16 else None))
    # Pinned host memory needs an accelerator; on CPU-only ranks plain memory is the same.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload,
                  reshard_after_forward=reshard_after_forward)
    tags = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for unit in unit_blocks(model, blocks_per_unit):
        fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)
    fully_shard(model, **kwargs)
    copy_tags(model, tags)  # FSDP2 swapped every parameter for a new DTensor one


def unit_blocks(model: nn.Module, blocks_per_unit: int) -> list[list[nn.Module]]:
    """The stage's blocks in FSDP2 units: runs of `blocks_per_unit` consecutive blocks of one
    chunk (a unit never spans two chunks: they run at different times of the schedule)."""
    units = []
    for chunk in model.chunks:
        blocks = [model.layers[str(i)] for i in chunk]
        units += [blocks[lo:lo + blocks_per_unit] for lo in range(0, len(blocks), blocks_per_unit)]
    return units


def copy_tags(model: nn.Module, tags: dict) -> None:
    """Put megazoo's shard tags (tp_dim, sequence_parallel, tied_to, ...; `tags`: {name:
    vars(p)} read before) back on parameters that were replaced; gradients and checkpoints
    read them."""
    for name, p in model.named_parameters():
        for key, value in tags[name].items():
            if not hasattr(p, key):
                setattr(p, key, value)


class SyncOnLastMicroBatch:
    """The stage as `run_pipeline` sees it, reducing gradients once per chunk and step.

    Each chunk's forward on micro-batch i puts a pre-hook on its output's grad_fn; the hook
    runs first in that output's backward and sets FSDP2's `requires_gradient_sync` of the
    chunk's blocks and of the stage root to `i == m - 1`. Schedules run a chunk's backwards
    in micro-batch order, so the last one (m - 1) is the one that reduce-scatters; the earlier
    ones accumulate unsharded gradients (the memory of a ZeRO-2 step, for m times fewer
    reduce-scatters). The root's own parameters (embedding, head) receive their last
    contribution in a micro-batch m - 1 backward as well, which reduces whatever they hold.
    """

    def __init__(self, model: nn.Module, num_microbatches: int):
        self._model, self._m = model, num_microbatches
        self._seen: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, chunk: int = 0, **kwargs):
        out = self._model(*args, chunk=chunk, **kwargs)
        i = self._seen.get(chunk, 0)
        self._seen[chunk] = i + 1
        if torch.is_grad_enabled() and out is not None and out.grad_fn is not None:
            units = [self._model.layers[str(k)] for k in self._model.chunks[chunk]]
            sync = i == self._m - 1
            out.grad_fn.register_prehook(lambda grads: _set_sync(units, self._model, sync))
        return out


def _set_sync(units, root, sync: bool) -> None:
    for unit in units:
        unit.set_requires_gradient_sync(sync, recurse=False)
    root.set_requires_gradient_sync(sync, recurse=False)
