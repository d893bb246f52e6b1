"""AdamW with Megatron's weight-decay grouping, and the global gradient norm of a sharded model.

    optimizer = build_optimizer(model, cfg)            # cfg: TrainingConfig
    norm = global_grad_norm(model, state)              # same value on every rank
    clip_gradients(model, norm, cfg.clip_grad)

The norm counts each parameter of the one-process model once, whatever the layout:
- tp-sharded parameters: each rank's sum of squares, summed over tp (a GQA fused QKV whose
  kv rows several tp ranks hold counts each of those rows on its lowest holder only);
- parameters replicated over tp: counted on tp rank 0 only;
- pp: summed over stages; the tied head copy on the last stage (`tied_to`) is skipped;
- sp and dp replicas hold the same reduced gradient: never summed over.
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


def _local_sq(p: torch.Tensor, g: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum of squares of the part of `g` this rank counts toward the global norm."""
    dim = tp_dim_of(p)
    if getattr(p, "tied_to", None) is not None:
        return g.new_zeros((), dtype=torch.float32)  # head copy of the tied embedding
    if dim is None:
        if state.tp.rank != 0:
            return g.new_zeros((), dtype=torch.float32)
        return g.float().square().sum()
    mask = _owned_rows(p, state.tp.rank, state.tp.size)
    g = g.float()
    if mask is not None:
        g = g.index_select(dim, mask.nonzero().flatten())
    return g.square().sum()


def global_grad_norm(model: nn.Module, state: ParallelState) -> float:
    """L2 norm of the full model's gradient (see the module docstring); inf/nan propagate."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        total = total + _local_sq(p, p.grad, state).cpu()
    device = params[0].grad.device if params else torch.device("cpu")
    total = total.to(device)
    for group in (state.tp, state.pp):
        if group.size > 1:
            dist.all_reduce(total, group=group.group)
    return math.sqrt(float(total)) if math.isfinite(float(total)) else float(total)


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
