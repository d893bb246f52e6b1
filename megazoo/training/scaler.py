"""Dynamic loss scaling for fp16 (Megatron / apex semantics, no torch.cuda dependency).

    loss * scaler.scale -> backward -> found_inf = scaler.unscale_and_check(model, group)
    scaler.update(found_inf)     # overflow: skip the step, halve; N clean steps: double

`unscale_and_check` divides every gradient by the scale and all-reduces an overflow flag
(MAX) over `group` (the whole world), so every rank skips the same steps and no inf/nan
ever reaches the weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after `window` clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 16, window: int = 1000,
                 min_scale: float = 1.0, factor: float = 2.0):
        if initial_scale < min_scale or window < 1 or factor <= 1:
            raise ValueError("need initial_scale >= min_scale, window >= 1 and factor > 1")
        self.scale, self.window, self.min_scale, self.factor = (float(initial_scale), window,
                                                                 float(min_scale), factor)
        self.clean_steps = 0

    def unscale_and_check(self, model: nn.Module, group=None) -> bool:
        """Divide grads by the scale; True (on every rank of `group`) if any is inf/nan."""
        found = torch.zeros(1)
        device = None
        for p in model.parameters():
            if p.grad is None:
                continue
            device = p.grad.device
            p.grad.mul_(1.0 / self.scale)
            if not torch.isfinite(p.grad).all():
                found.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            found = found.to(device or "cpu")
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> None:
        """After a step: halve (not below min_scale) on overflow, else count toward growth."""
        if found_inf:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= self.factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
