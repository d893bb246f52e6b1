"""The one AdamW builder: Megatron's weight-decay grouping (matrices decayed, 1-D parameters
and biases not), used by every backend.

    optimizer = build_optimizer(params_or_model, cfg)      # cfg: TrainingConfig
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.run import TrainingConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (decayed) and 1-D parameters, biases and norms (not)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(groups: list[dict], cfg: TrainingConfig, **kwargs) -> torch.optim.AdamW:
    """torch AdamW over `groups` (`param_groups`, or pieces of flat buffers) with the run's
    betas, eps and initial lr (the lr clock sets it every step); `kwargs`: fused / foreach."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, **kwargs)
