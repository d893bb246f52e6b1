"""Dynamic loss scaling for fp16 (Megatron / apex semantics): the engine multiplies the loss
by `scale` before backward and divides it out of the gradient norm and the optimizer step; a
step whose norm is inf / nan is skipped and halves the scale, `window` clean steps double it.
"""
from __future__ import annotations


class DynamicLossScaler:
    """Loss scale that halves on overflow and doubles after `window` clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 16, window: int = 1000,
                 min_scale: float = 1.0):
        if initial_scale < min_scale or window < 1:
            raise ValueError("need initial_scale >= min_scale and window >= 1")
        self.scale, self.window, self.min_scale = float(initial_scale), window, float(min_scale)
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """After a step: halve (not below min_scale) on overflow, else count toward growth."""
        if found_inf:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
