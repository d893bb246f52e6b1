"""The fused q/k/v projection taken apart for attention, with RoPE applied on the way.

qkv [s, b, kc, gs + 2, d] (kc kv groups, each of gs query heads, a key head and a value head:
the layout of the fused column-parallel projection, see heads.py) ->
q [s, b, kc gs, d], k and v [s, b, kc, d].

Forward, without RoPE: k and v are views of qkv, q is a view for gs = 1 and a copy otherwise
(the query heads of one group are not adjacent to the next group's). With RoPE: v is a view,
and q and k are rotated straight out of qkv by one fused kernel on CUDA (no copy of q first).

Backward writes the one gradient of qkv in one fused kernel on CUDA (rather than autograd's
RoPE backward then a `cat` along the interleaved head axis): dq and dk rotated back (the
inverse rotation) and dv, each into its heads' place. CPU runs eagerly (`fused_on_gpu`).
"""
from __future__ import annotations

import torch

from ..kernels.fusion import fused_on_gpu, rope_rotate, rotate_half
from .positions import check_rope_factors


def _rotate_back(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `rope_rotate`'s input: dy cos + rotate_half^T(dy sin), where
    rotate_half^T([g1, g2]) = [g2, -g1] = -rotate_half([g1, g2])."""
    return dy * cos - rotate_half(dy * sin)


@fused_on_gpu
def _rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) of qkv [s, b, kc, gs + 2, d], rotated; cos, sin [s, 1 or b, 1, 1, d]."""
    s, b, kc, width, d = qkv.shape
    gs = width - 2
    q = rope_rotate(qkv[:, :, :, :gs], cos, sin).reshape(s, b, kc * gs, d)
    return q, rope_rotate(qkv[:, :, :, gs], cos[:, :, 0], sin[:, :, 0])


@fused_on_gpu
def _join(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos, sin) -> torch.Tensor:
    """The gradient of qkv [s, b, kc, gs + 2, d] from dq [s, b, kc gs, d], dk, dv [s, b, kc, d];
    with cos, sin (not None) those of rotated q and k, each rotated back first."""
    s, b, kc, d = dk.shape
    dq = dq.reshape(s, b, kc, -1, d)
    if cos is not None:
        dq, dk = _rotate_back(dq, cos, sin), _rotate_back(dk, cos[:, :, 0], sin[:, :, 0])
    return torch.cat([dq, dk.unsqueeze(3), dv.unsqueeze(3)], dim=3)


class _SplitQKV(torch.autograd.Function):
    """qkv -> (q, k, v), RoPE optional (cos, sin None without); see the module docstring.
    Missing output gradients arrive as zeros (autograd materializes them)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos, sin):
        s, b, kc, width, d = qkv.shape
        gs = width - 2
        if cos is None:
            q, k = qkv[:, :, :, :gs].reshape(s, b, kc * gs, d), qkv[:, :, :, gs]
        else:
            q, k = _rope_split(qkv, cos, sin)
            ctx.save_for_backward(cos, sin)
        return q, k, qkv[:, :, :, gs + 1]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors or (None, None)  # nothing saved without RoPE
        return _join(dq, dk, dv, cos, sin), None, None


def split_qkv(qkv: torch.Tensor, gs: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """(q [s, b, kc gs, d], k [s, b, kc, d], v [s, b, kc, d]) of qkv [s, b, kc, gs + 2, d];
    with `rope` = (cos, sin) [s, 1 or b, d], q and k rotated (as `positions.apply_rope`)."""
    s, b, kc, width, d = qkv.shape
    if width != gs + 2:
        raise ValueError(f"split_qkv: qkv {tuple(qkv.shape)} must have gs + 2 = {gs + 2} "
                         f"heads per kv group")
    if rope is None:
        return _SplitQKV.apply(qkv, None, None)
    cos, sin = rope
    check_rope_factors("split_qkv", cos, qkv)
    view = (s, cos.shape[1], 1, 1, d)
    return _SplitQKV.apply(qkv, cos.reshape(view), sin.reshape(view))
