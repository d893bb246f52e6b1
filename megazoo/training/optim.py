"""AdamW with Megatron's weight-decay grouping, and the global gradient norm of a sharded model.

    optimizer = build_optimizer(model, cfg)            # cfg: TrainingConfig
    norm = global_grad_norm(model, state)              # same value on every rank
    clip_gradients(model, norm, cfg.clip_grad)

The norm counts each parameter of the one-process model once, whatever the layout:
- tp-sharded parameters: each rank's sum of squares, summed over tp (a GQA fused QKV whose
  kv rows several tp ranks hold counts each of those rows on its lowest holder only);
- parameters replicated over tp: counted on tp rank 0 only;
- pp: summed over stages; the tied head copy on the last stage (`tied_to`) is skipped;
- sp and dp replicas hold the same reduced gradient: never summed over; FSDP2's dp x sp
  shards are disjoint pieces of it: summed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..layers.sharding import tp_dim_of
from ..parallel.state import ParallelState
from .config import TrainingConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (decayed) and 1-D parameters, biases and norms (not)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`; the learning rate is set each step by the schedule."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             foreach=False)


def _owned_rows(p: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """Bool mask over `tp_dim` of the rows this tp rank counts (None: all of them)."""
    index = getattr(p, "tp_index", None)
    if index is None or tp_size == 1:
        return None
    seen = set()
    for r in range(tp_rank):
        seen.update(int(i) for i in index(r))
    return torch.tensor([int(i) not in seen for i in index(tp_rank)], device=p.device)


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
    if getattr(p, "tied_to", None) is not None:
        return None  # head copy of the tied embedding
    dim = tp_dim_of(p)
    if dim is None:
        return g if state.tp.rank == 0 else None
    mask = _owned_rows(p, state.tp.rank, state.tp.size)
    if mask is None:
        return g
    rows = fsdp_rows(p, g) if dim == 0 else None
    if rows is not None:
        mask = mask[rows]
    return g.index_select(dim, mask.nonzero().flatten())


_ROW = 1 << 16


def _norm(g: torch.Tensor) -> torch.Tensor:
    """L2 norm in fp32, one pass, no squared copy. On the host a whole-tensor norm runs on one
    thread (ATen parallelises its L2 fast path over output elements): there the tensor is cut
    into rows of 64k elements, whose norms run in parallel (1.3B host gradients: 0.5 s -> ~0.05 s)."""
    if g.device.type != "cpu" or g.numel() < 4 * _ROW:
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    flat = g.reshape(-1)
    main = flat.numel() - flat.numel() % _ROW
    parts = torch.linalg.vector_norm(flat[:main].view(-1, _ROW), dim=1, dtype=torch.float32)
    tail = torch.linalg.vector_norm(flat[main:], dtype=torch.float32).reshape(1)
    return torch.linalg.vector_norm(torch.cat([parts, tail]))


def global_grad_norm(model: nn.Module, state: ParallelState) -> float:
    """L2 norm of the full model's gradient (see the module docstring); inf/nan propagate.

    FSDP2 (DTensor) gradients: each rank counts its own shard of what it counts, and the
    shards are summed over dp x sp as well. No squared copies (`_norm`), one host sync per
    device.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        g = _counted(p, state)
        if g is not None:
            by_device.setdefault(g.device, []).append(_norm(g))
    total = torch.zeros((), dtype=torch.float32)
    for norms in by_device.values():
        total += torch.stack(norms).square().sum().cpu()
    groups = [state.tp, state.pp]
    if any(hasattr(p, "placements") for p in params):
        groups.append(state.dp_sp)
    for group in groups:
        if group.size > 1:
            on_comm_device(total, lambda t, g=group: dist.all_reduce(t, group=g.group))
    value = float(total)
    return math.sqrt(value) if math.isfinite(value) else value


def on_comm_device(t: torch.Tensor, op) -> None:
    """Run the in-place collective `op` on `t`, through the GPU when `t` is a host tensor
    (offloaded gradients, a norm summed on the host) and the process group is NCCL."""
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        moved = t.to(torch.cuda.current_device())
        op(moved)
        t.copy_(moved)
    else:
        op(t)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (or the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def clip_gradients(model: nn.Module, norm: float, max_norm: float) -> None:
    """Scale every gradient by max_norm / norm when the norm exceeds max_norm (> 0).

    A DTensor gradient (FSDP2) is scaled on its local shard."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return
    factor = max_norm / (norm + 1e-6)
    for p in model.parameters():
        if p.grad is not None:
            local(p.grad).mul_(factor)
