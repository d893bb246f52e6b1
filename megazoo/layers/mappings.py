"""Collectives as autograd pairs (the f and g operators of Megatron-LM, Shoeybi et al. 2019).

Each region is a private `autograd.Function` and a public snake_case wrapper that takes the
group and returns its input unchanged when the group has one rank. Activations are laid out
`[s, b, h]`: tensor-parallel splits act on the last dimension, sequence splits on the first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import Group, group_rank, group_size, process_group


# ---- raw collectives (no autograd) -------------------------------------------------------

def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, out of place (the input may be aliased elsewhere). No autograd."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=process_group(group))
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim`."""
    world = group_size(group)
    if x.shape[dim] % world != 0:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {world}: pad it or choose a size that divides")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    world = group_size(group)
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=process_group(group))
    if dim in (0, -x.dim()):
        return out
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, then keep this rank's chunk of the first dimension."""
    world = group_size(group)
    if x.shape[0] % world != 0:
        raise ValueError(f"sequence dimension {x.shape[0]} is not divisible by the group size "
                         f"{world}: choose a sequence length that divides")
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=process_group(group))
    return out


# ---- tensor-parallel regions (last dimension) ---------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: forward identity, backward all-reduce. x_full [.., h] -> x_full [.., h]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_full):
        return all_reduce(grad_full, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce, backward identity. y_partial [.., h] -> y_full [.., h]."""

    @staticmethod
    def forward(ctx, y_partial, group):
        return all_reduce(y_partial, group)

    @staticmethod
    def backward(ctx, grad_full):
        return grad_full, None


class _ScatterToTP(torch.autograd.Function):
    """forward split last dim, backward all-gather. x_full [.., h] -> x_shard [.., h/tp]."""

    @staticmethod
    def forward(ctx, x_full, group):
        ctx.group = group
        return _split(x_full, -1, group)

    @staticmethod
    def backward(ctx, grad_shard):
        return _gather(grad_shard, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """forward all-gather last dim, backward split. x_shard [.., h/tp] -> x_full [.., h]."""

    @staticmethod
    def forward(ctx, x_shard, group):
        ctx.group = group
        return _gather(x_shard, -1, group)

    @staticmethod
    def backward(ctx, grad_full):
        return _split(grad_full, -1, ctx.group), None


# ---- sequence regions (first dimension, Megatron sequence parallelism) ---------------------

class _ScatterToSequence(torch.autograd.Function):
    """forward split first dim, backward all-gather. x [s, b, h] -> x_shard [s/n, b, h]."""

    @staticmethod
    def forward(ctx, x_full, group):
        ctx.group = group
        return _split(x_full, 0, group)

    @staticmethod
    def backward(ctx, grad_shard):
        return _gather(grad_shard, 0, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """Megatron-SP's all-gather before a column-parallel matmul (the f of SP).

    forward all-gather first dim, backward reduce-scatter (each rank's full-sequence gradient
    is a partial sum over the tensor-parallel ranks). x_shard [s/n, b, h] -> x_full [s, b, h].
    """

    @staticmethod
    def forward(ctx, x_shard, group):
        ctx.group = group
        return _gather(x_shard, 0, group)

    @staticmethod
    def backward(ctx, grad_full_partial):
        return _reduce_scatter(grad_full_partial, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Megatron-SP's reduce-scatter after a row-parallel matmul (the g of SP).

    forward reduce-scatter first dim, backward all-gather. y_partial [s, b, h] -> y [s/n, b, h].
    """

    @staticmethod
    def forward(ctx, y_partial, group):
        ctx.group = group
        return _reduce_scatter(y_partial, group)

    @staticmethod
    def backward(ctx, grad_shard):
        return _gather(grad_shard, 0, ctx.group), None


def _wrap(fn):
    """Public wrapper: short-circuit when the group has one rank."""

    def region(x: torch.Tensor, group: Group) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return fn.apply(x, group)

    region.__doc__ = fn.__doc__
    return region


copy_to_tensor_parallel_region = _wrap(_CopyToTP)
reduce_from_tensor_parallel_region = _wrap(_ReduceFromTP)
scatter_to_tensor_parallel_region = _wrap(_ScatterToTP)
gather_from_tensor_parallel_region = _wrap(_GatherFromTP)
scatter_to_sequence_parallel_region = _wrap(_ScatterToSequence)
gather_from_sequence_parallel_region = _wrap(_GatherFromSequence)
reduce_scatter_to_sequence_parallel_region = _wrap(_ReduceScatterToSequence)


class _GatherSequenceReplicated(torch.autograd.Function):
    """forward all-gather first dim, backward keep this rank's chunk.

    For outputs that every rank then uses identically (the full logits a model returns on
    each rank): each rank's gradient of the gathered tensor is already the full one, so the
    backward takes its chunk instead of reduce-scattering (which would count it n times).
    x_shard [s/n, ...] -> x_full [s, ...].
    """

    @staticmethod
    def forward(ctx, x_shard, group):
        ctx.group = group
        return _gather(x_shard, 0, group)

    @staticmethod
    def backward(ctx, grad_full):
        return _split(grad_full, 0, ctx.group), None


gather_sequence_replicated = _wrap(_GatherSequenceReplicated)
