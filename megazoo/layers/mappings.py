"""Collectives as autograd pairs (the f and g operators of Megatron-LM, Shoeybi et al. 2019).

Each region is a private `autograd.Function` and a public snake_case wrapper that takes the
group and returns its input unchanged when the group has one rank. Activations are laid out
`[s, b, h]`: tensor-parallel splits act on the last dimension, sequence splits on the first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_flat, reduce_scatter_flat
from .groups import Group, group_rank, group_size, process_group


# ---- raw collectives (no autograd) -------------------------------------------------------

def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, out of place (the input may be aliased elsewhere). No autograd.

    A one-rank group (None, or a GroupInfo of size 1, whose `.group` is None) issues nothing:
    passing None on to torch.distributed would mean WORLD.
    """
    out = x.contiguous().clone()
    if group_size(group) > 1:
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
    all_gather_flat(out, x, group=process_group(group))
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
    reduce_scatter_flat(out, x.contiguous(), group=process_group(group))
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


# ---- Ulysses all-to-all (sequence <-> heads) -------------------------------------------------

def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """x [s/n, *mid, n*f] -> [s, *mid, f]: feature block j goes to rank j, sequences stack.

    One copy (moving the destination block outermost) and one all_to_all_single.
    """
    n = group_size(group)
    if x.shape[-1] % n != 0:
        raise ValueError(f"the last dimension of {tuple(x.shape)} is not divisible by the "
                         f"Ulysses group size {n}: choose heads divisible by sp")
    s_local, mid, f = x.shape[0], tuple(x.shape[1:-1]), x.shape[-1] // n
    send = x.reshape(s_local, -1, n, f).permute(2, 0, 1, 3).contiguous()  # [n, s/n, m, f]
    recv = torch.empty_like(send)  # [n (source rank = sequence block), s/n, m, f]
    dist.all_to_all_single(recv, send, group=process_group(group))
    return recv.view((n * s_local,) + mid + (f,))


def _heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """y [s, *mid, f] -> [s/n, *mid, n*f]: sequence block j goes to rank j, features concat.

    One all_to_all_single (sequence blocks are already outermost) and one copy after it.
    """
    n = group_size(group)
    if y.shape[0] % n != 0:
        raise ValueError(f"sequence length {y.shape[0]} is not divisible by the Ulysses group "
                         f"size {n}: pad the sequence to a multiple of {n}")
    s_local, mid, f = y.shape[0] // n, tuple(y.shape[1:-1]), y.shape[-1]
    send = y.contiguous()  # [s, *mid, f] = [n (destination), s/n, m, f]
    recv = torch.empty_like(send)  # [n (source rank = feature block), s/n, m, f]
    dist.all_to_all_single(recv, send, group=process_group(group))
    out = recv.view(n, s_local, -1, f).permute(1, 2, 0, 3)  # [s/n, m, n, f]
    return out.reshape((s_local,) + mid + (n * f,))


class _SequenceToHeads(torch.autograd.Function):
    """Ulysses' first all-to-all: from a sequence shard of every head to the full sequence of
    a block of heads. forward: sequence-to-heads all-to-all, backward: heads-to-sequence.

    | tensor | shape |
    |---|---|
    | x_seq_shard (input) | [s/n, *mid, n*f]: feature block j is for rank j |
    | x_head_shard (output) | [s, *mid, f]: rows [j s/n, (j+1) s/n) came from rank j |
    """

    @staticmethod
    def forward(ctx, x_seq_shard, group):
        ctx.group = group
        return _sequence_to_heads(x_seq_shard, group)

    @staticmethod
    def backward(ctx, grad_head_shard):
        return _heads_to_sequence(grad_head_shard, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """Ulysses' second all-to-all, the inverse of the first. forward: heads-to-sequence,
    backward: sequence-to-heads.

    | tensor | shape |
    |---|---|
    | y_head_shard (input) | [s, *mid, f]: the full sequence of this rank's feature block |
    | y_seq_shard (output) | [s/n, *mid, n*f]: feature block j came from rank j |
    """

    @staticmethod
    def forward(ctx, y_head_shard, group):
        ctx.group = group
        return _heads_to_sequence(y_head_shard, group)

    @staticmethod
    def backward(ctx, grad_seq_shard):
        return _sequence_to_heads(grad_seq_shard, ctx.group), None


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
all_to_all_sequence_to_heads = _wrap(_SequenceToHeads)
all_to_all_heads_to_sequence = _wrap(_HeadsToSequence)


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
