"""Model FLOPs of one training iteration: what the run logs as TFLOP/s and MFU, and what
the planner's step-time model divides by its time.

Megatron's formula (Narayanan et al. 2021, with the logit layer), for B sequences of s
tokens, l layers, width h, vocabulary V, forward and backward (no recompute):

    F = 72 B s l h^2 (1 + s / (6 h)) + 6 B s h V
"""
from __future__ import annotations


def flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one training iteration (forward + backward), see the module docstring."""
    return (72.0 * batch * seq * layers * hidden ** 2 * (1.0 + seq / (6.0 * hidden))
            + 6.0 * batch * seq * hidden * vocab)
