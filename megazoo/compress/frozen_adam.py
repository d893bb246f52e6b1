"""AdamW with its second moment frozen: 1-bit Adam's rule for compressed gradients.

    floor_variance(optimizer, fraction)          # once, when v freezes
    frozen_variance_step(optimizer, lr, grad_divisor, frozen_at)

Adam divides each coordinate by the root of its running mean of squared gradients, v. Fed
with compressed gradients, v learns the compression's magnitudes instead of the gradient's:
1bit gives every element of a block the block's mean |x|, so elements smaller than their
block's mean are slowed down; topk sends a coordinate its accumulated residual once in many
steps, and v's burst then damps its whole update. 1-bit Adam (Tang et al. 2021) therefore
runs Adam uncompressed for a warmup, then freezes v. With v fixed the update is linear in the
gradient (momentum SGD with a per-coordinate step size), so error feedback's promise, that
what was not sent arrives later, holds for the update too.

v is floored when it freezes (`floor_variance`) so that no coordinate whose v froze near zero
(an embedding row of a token not yet seen) divides its first gradient by ~eps. The step is
torch AdamW's (decoupled weight decay, bias-corrected momentum) with v read, never written,
and its bias correction 1 - beta2^frozen_at fixed at the step count where it froze, over the
same per-piece state (step counters included) as the fused kernel, so checkpoints and the
unfrozen step are unchanged.
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def floor_variance(optimizer: torch.optim.AdamW, fraction: float) -> None:
    """Raise each parameter's v to at least fraction^2 times its mean. One host sync each."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            v = optimizer.state[p]["exp_avg_sq"]
            if v.numel():
                v.clamp_(min=float(v.mean()) * fraction * fraction)


@torch.no_grad()
def frozen_variance_step(optimizer: torch.optim.AdamW, lr: float, grad_divisor: float,
                         frozen_at: int) -> None:
    """One AdamW step on every group of `optimizer` with `exp_avg_sq` left as it is."""
    for group in optimizer.param_groups:
        params = group["params"]
        if not params:
            continue
        beta1, beta2 = group["betas"]
        states = [optimizer.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        step = float(steps[0])
        exp_avg = [s["exp_avg"] for s in states]
        grads = [p.grad for p in params]
        if grad_divisor != 1.0:
            grads = torch._foreach_div(grads, grad_divisor)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
        denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2 ** frozen_at))
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-lr / (1.0 - beta1 ** step))
