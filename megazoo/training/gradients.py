"""The gradient contract, once: completion, the global norm, clipping.

Completion (what turns each rank's backward into the one-process model's gradient):
- sp (Ulysses): each sp rank saw different tokens of the one mean loss: SUM over sp;
- dp: each replica computed the mean loss of its own micro-batches: AVERAGE over dp;
  together: divide by dp, sum over dp x sp (`state.dp_sp`);
- tp under Megatron SP: parameters tagged `sequence_parallel` (norms, row biases) saw only
  their rank's sequence shard: SUM over tp;
- GQA kv rows replicated over several tp ranks: summed over those ranks (the layer's tensor
  hook `SumReplicatedKV`; engines that replace parameters call it on their shards);
- pp with tied embeddings: the embedding (first stage) and its head copy (last stage) are
  summed over `state.embedding`.
Who does what: the plain backend's `GradBuffer` does the dp x sp part per bucket and the
Megatron-SP tp sum once per step (one all-reduce per bucket, before its dp x sp reduction);
DeepSpeed's engine gets the tp sum per micro-batch from `hook_sequence_parallel_grads`; the
tied sum comes from `sum_tied_embedding`. `allreduce_gradients` does all of it
per parameter after backward (reference for tests); `complete_sharded_gradients` does the
rest for FSDP2's shards (whose reduce-scatter averaged over dp x sp).

The norm counts each parameter of the one-process model once, whatever the layout:
- tp-sharded parameters: each rank's sum of squares, summed over tp (a GQA fused QKV whose
  kv rows several tp ranks hold counts each of those rows on its lowest holder only);
- parameters replicated over tp: counted on tp rank 0 only;
- pp: summed over stages; the tied head copy on the last stage (`tied_to`) is skipped;
- sp and dp replicas hold the same reduced gradient: never summed over; FSDP2's and the
  distributed optimizer's dp x sp shards are disjoint pieces of it: summed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..layers.linear import allreduce_sequence_parallel_grads
from ..layers.sharding import tp_dim_of
from ..parallel.device import comm_device, local_device
from ..parallel.state import ParallelState


# -- which part of a parameter's gradient this rank counts ---------------------------------
def counted_rows(p: torch.Tensor, state: ParallelState):
    """What of p's (tp-local, full) gradient this rank counts in the norm: None (nothing),
    "all", or a bool mask over dim 0 (GQA kv rows counted on their lowest tp holder)."""
    if getattr(p, "tied_to", None) is not None:
        return None  # head copy of the tied embedding
    dim = tp_dim_of(p)
    if dim is None:
        return "all" if state.tp.rank == 0 else None
    index = getattr(p, "tp_index", None)
    if index is None or state.tp.size == 1:
        return "all"
    if dim != 0:
        raise ValueError("a tp_index parameter must be split along dim 0")
    seen = set()
    for r in range(state.tp.rank):
        seen.update(int(i) for i in index(r))
    return torch.tensor([int(i) not in seen for i in index(state.tp.rank)])


def counted_flat_ranges(params_with_offsets, state: ParallelState) -> list[tuple[int, int]]:
    """Flat [lo, hi) ranges of a contiguous gradient buffer that this rank counts, merged.
    `params_with_offsets`: (parameter, offset of its first element in the buffer)."""
    ranges = []
    for p, off in params_with_offsets:
        rows = counted_rows(p, state)
        if rows is None:
            continue
        if isinstance(rows, str):
            ranges.append((off, off + p.numel()))
            continue
        row = p.numel() // p.shape[0]
        for i in rows.nonzero().flatten().tolist():
            ranges.append((off + i * row, off + (i + 1) * row))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def intersect(ranges: list[tuple[int, int]], owned: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `ranges` inside `owned` (both sorted, disjoint)."""
    out = []
    for lo, hi in ranges:
        for a, b in owned:
            a, b = max(lo, a), min(hi, b)
            if a < b:
                out.append((a, b))
    return out


def sum_over(total: torch.Tensor, groups) -> None:
    """All-reduce (sum) `total` in place over each group of more than one rank."""
    for group in groups:
        if group.size > 1:
            on_comm_device(total, lambda t, g=group: dist.all_reduce(t, group=g.group), group.group)


def flat_grad_norm(views: list[torch.Tensor], state: ParallelState, sharded: bool) -> float:
    """L2 norm of the model's gradient from the counted views of a flat fp32 buffer (one
    multi-tensor norm kernel)."""
    device = views[0].device if views else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    if views:
        total += torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).square().sum()
    return _global_norm(total, state, sharded)


def _global_norm(total: torch.Tensor, state: ParallelState, sharded: bool) -> float:
    """The norm from this rank's sum of squares `total`: summed over tp and pp (and dp x sp
    for shards); one host sync, inf / nan kept."""
    sum_over(total, [state.tp, state.pp] + ([state.dp_sp] if sharded else []))
    value = float(total)
    return math.sqrt(value) if math.isfinite(value) else value


def clip_divisor(norm: float, max_norm: float) -> float:
    """What to divide every gradient by so that the norm is at most `max_norm` (1: none)."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    return (norm + 1e-6) / max_norm


# -- per-parameter norm and clipping (FSDP2, DeepSpeed-free references) ---------------------
def fsdp_rows(p: torch.Tensor, g: torch.Tensor) -> slice | None:
    """The dim-0 rows of the tp-local parameter that this rank's FSDP2 shard `g` holds."""
    placements = getattr(p, "placements", None)
    if not placements or not placements[0].is_shard(0):
        return None
    n, k = p.shape[0], p.device_mesh.size()
    start = min(p.device_mesh.get_local_rank() * math.ceil(n / k), n)  # torch.chunk's split
    return slice(start, start + g.shape[0])


def _counted(p: torch.Tensor, state: ParallelState) -> torch.Tensor | None:
    """The part of p's local gradient this rank counts toward the global norm (None: none)."""
    g = local(p.grad)
    rows = counted_rows(p, state)
    if rows is None or isinstance(rows, str):
        return None if rows is None else g
    shard = fsdp_rows(p, g)
    if shard is not None:
        rows = rows[shard]
    return g.index_select(0, rows.to(g.device).nonzero().flatten())


_ROW = 1 << 16


def _norm(g: torch.Tensor) -> torch.Tensor:
    """L2 norm in fp32, one pass, no squared copy. On the host ATen runs a whole-tensor norm
    on one thread, so a large tensor is cut into rows of 64k elements normed in parallel."""
    if g.device.type != "cpu" or g.numel() < 4 * _ROW:
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    flat = g.reshape(-1)
    main = flat.numel() - flat.numel() % _ROW
    parts = torch.linalg.vector_norm(flat[:main].view(-1, _ROW), dim=1, dtype=torch.float32)
    tail = torch.linalg.vector_norm(flat[main:], dtype=torch.float32).reshape(1)
    return torch.linalg.vector_norm(torch.cat([parts, tail]))


def global_grad_norm(model: nn.Module, state: ParallelState) -> float:
    """L2 norm of the full model's gradient from each parameter's `.grad` (see the module
    docstring); inf/nan propagate. FSDP2 (DTensor) gradients: each rank counts its own shard
    of what it counts, and the shards are summed over dp x sp as well."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        g = _counted(p, state)
        if g is not None:
            by_device.setdefault(g.device, []).append(_norm(g))
    # The sum lives where the gradients do (the GPU unless offloaded: NCCL-only groups take
    # no host tensor, and a host sum would sync once per device); the one host sync is
    # `_global_norm`'s read.
    device = next(iter(by_device), None) or _grad_device(params)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for norms in by_device.values():
        total += torch.stack(norms).square().sum().to(device)
    return _global_norm(total, state, any(hasattr(p, "placements") for p in params))


def _grad_device(params: list[torch.Tensor]) -> torch.device:
    """Where a rank that counts none of its gradients sums its zero: with its gradients, or
    on this rank's device when it has none."""
    return local(params[0].grad).device if params else local_device()


def on_comm_device(t: torch.Tensor, op, group=None) -> None:
    """Run the in-place collective `op` over `group` on `t`, through this rank's accelerator
    when `group` has no backend for `t`'s device (`parallel.device.comm_device`: a host
    tensor, such as an offloaded gradient, under NCCL)."""
    target = comm_device(t.device, group)
    if target == t.device:
        op(t)
        return
    moved = t.to(target)
    op(moved)
    t.copy_(moved)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (or the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


# -- completion -------------------------------------------------------------------------
def tied_embedding_weight(model: nn.Module, state: ParallelState):
    """The parameter this stage holds of a tied embedding split over pipeline ends (None
    when the embedding is not tied across stages or this stage holds neither end)."""
    if state.embedding.size == 1 or not getattr(model.config, "tie_word_embeddings", False):
        return None
    if getattr(model, "pre_process", False):
        return model.embedding.word_embeddings.weight
    if getattr(model, "post_process", False):
        return model.output_layer.weight
    return None


def sum_tied_embedding(model: nn.Module, state: ParallelState, grad_of=None) -> None:
    """Sum the tied embedding's gradient over its two pipeline ends (`grad_of(weight)`:
    where the gradient lives, default `.grad`; a missing one contributes zeros)."""
    weight = tied_embedding_weight(model, state)
    if weight is None:
        return
    grad = grad_of(weight) if grad_of else weight.grad
    if grad is None:
        grad = torch.zeros_like(local(weight))
    on_comm_device(local(grad), lambda t: dist.all_reduce(t, group=state.embedding.group),
                   state.embedding.group)


def hook_sequence_parallel_grads(model: nn.Module, state: ParallelState) -> list:
    """Tensor hooks summing each Megatron-SP parameter's gradient over tp as autograd
    produces it (per micro-batch, before accumulation: equal to summing the accumulated
    one; same graph on every tp rank, so the collectives match). Returns the handles."""
    if state.tp.size == 1 or not state.config.sequence_parallel:
        return []
    group = state.tp.group

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return [p.register_hook(hook) for p in model.parameters()
            if p.requires_grad and getattr(p, "sequence_parallel", False)]


def allreduce_gradients(model: nn.Module, state: ParallelState) -> None:
    """The whole completion on every parameter's `.grad` after backward (in place).

    An engine that averages over dp x sp itself (DeepSpeed with a seq-data-parallel group)
    gives 1/sp of the right gradient with this model's loss: scale the loss by sp for it.
    """
    for p in model.parameters():
        if p.grad is not None and state.dp_sp.size > 1:
            dist.all_reduce(p.grad, group=state.dp_sp.group)
            if state.dp.size > 1:
                p.grad.div_(state.dp.size)
    allreduce_sequence_parallel_grads(model, state.tp)
    sum_tied_embedding(model, state)


def complete_sharded_gradients(model: nn.Module, state: ParallelState) -> None:
    """The rest of the completion on FSDP2's local gradient shards, after its reduce-scatter
    averaged over dp x sp: times sp, Megatron-SP tp sums (tp ranks with the same dp x sp
    index hold the same rows, and the reduce-scatter is linear), the tp sum of replicated
    GQA kv rows (FSDP2's parameters drop the layer's tensor hook), the tied-embedding sum
    (both ends are sharded identically)."""
    grads = [p for p in model.parameters() if p.grad is not None]
    if state.sp.size > 1:
        for p in grads:
            local(p.grad).mul_(state.sp.size)
    if state.tp.size > 1:
        for p in grads:
            if state.config.sequence_parallel and getattr(p, "sequence_parallel", False):
                on_comm_device(local(p.grad), lambda t: dist.all_reduce(t, group=state.tp.group),
                               state.tp.group)
            kv = getattr(p, "sum_replicated_kv", None)
            if kv is not None:
                rows = fsdp_rows(p, local(p.grad)) or slice(0, p.shape[0])
                on_comm_device(local(p.grad), lambda t: kv.sum_rows(t, rows.start), state.tp.group)
    sum_tied_embedding(model, state)
