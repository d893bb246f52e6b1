"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr.

    lr = learning_rate(step, cfg)        # step counts from 0; pure function of step and cfg

Megatron's convention: step s of the warmup uses lr * (s + 1) / warmup (never 0), and after
`decay_iters` the rate stays at min_lr.
"""
from __future__ import annotations

import math

from ..config.run import TrainingConfig


def learning_rate(step: int, cfg: TrainingConfig) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    warmup, decay = cfg.lr_warmup_iters, cfg.decay_iters
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if step >= decay or decay <= warmup:
        return cfg.min_lr
    progress = (step - warmup) / (decay - warmup)  # in [0, 1)
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:  # cosine
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
