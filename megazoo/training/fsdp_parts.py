"""Pieces of `FSDP2Engine`: the mesh, the sharding of a stage, and gradient completion.

Sharding. Each transformer block of the stage (every chunk's blocks) is its own FSDP2 unit,
and the stage object itself (embedding, final norm, head) the root unit, all over one
1-D mesh made of our `dp_sp` group: every rank that holds the same tp shard of the same
pipeline stage. FSDP2 shards each parameter along dim 0 over that mesh; tp shards stay shards.

Gradient scaling. FSDP2's reduce-scatter averages over the mesh (dp x sp). The right
reduction is "sum over sp, mean over dp" (`allreduce_gradients`), so after the whole step's
backward passes the local gradient shards are multiplied by sp (FSDP2's
`set_gradient_divide_factor(dp)` would do it inside the reduce-scatter, but it needs
ReduceOp.PREMUL_SUM, which gloo lacks). Then:
- Megatron-SP parameters (`sequence_parallel`) sum their local gradient shards over tp
  (tp ranks holding the same dp_sp index hold the same rows of the same gradient, and the
  reduce-scatter is linear, so summing shards equals summing the full gradients);
- with pp > 1 and tied embeddings, the embedding (first stage) and its head copy (last
  stage) sum their shards over `state.embedding` (both are sharded identically: same shape,
  same mesh size, same dp_sp index on both ends of the group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.state import ParallelState
from .optim import fsdp_rows, local, on_comm_device


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
                cpu_offload: bool, reshard_after_forward: bool) -> None:
    """fully_shard every block, then the stage root (in place; see the module docstring)."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; on CPU-only ranks plain memory is the same.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload,
                  reshard_after_forward=reshard_after_forward)
    tags = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP2 swaps every parameter for a new DTensor one: carry megazoo's shard tags over
    # (tp_dim, sequence_parallel, tied_to, ...), which the gradient code and checkpoints read.
    for name, p in model.named_parameters():
        for key, value in tags[name].items():
            if not hasattr(p, key):
                setattr(p, key, value)


def complete_gradients(model: nn.Module, state: ParallelState) -> None:
    """sp scaling, Megatron-SP tp sums, the tp sum of replicated GQA kv rows (FSDP2's
    parameters drop the tensor hook that does it outside FSDP2) and the tied-embedding sum,
    on the local shards."""
    if state.sp.size > 1:
        for p in model.parameters():
            if p.grad is not None:
                local(p.grad).mul_(state.sp.size)
    if state.tp.size > 1:
        for p in model.parameters():
            if p.grad is None:
                continue
            if state.config.sequence_parallel and getattr(p, "sequence_parallel", False):
                on_comm_device(local(p.grad), lambda t: dist.all_reduce(t, group=state.tp.group))
            kv = getattr(p, "sum_replicated_kv", None)  # GQA kv rows held by several tp ranks
            if kv is not None:
                rows = fsdp_rows(p, local(p.grad)) or slice(0, p.shape[0])
                on_comm_device(local(p.grad), lambda t: kv.sum_rows(t, rows.start))
    if state.embedding.size == 1 or not getattr(model.config, "tie_word_embeddings", False):
        return
    weight = None
    if model.pre_process:
        weight = model.embedding.word_embeddings.weight
    elif model.post_process:
        weight = model.output_layer.weight
    if weight is not None:
        grad = weight.grad
        if grad is None:  # this stage never used it this step: contribute zeros
            grad = torch.zeros_like(local(weight))
        on_comm_device(local(grad), lambda t: dist.all_reduce(t, group=state.embedding.group))


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
