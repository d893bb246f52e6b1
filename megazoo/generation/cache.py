"""The static key/value cache of one pipeline stage, and the per-step attention inputs.

**Batching: left padding.** Prompts of different lengths are left-padded to the longest, P
tokens, so every row writes its next token into the same cache slot: slot t of row b holds
the token at position t - pad[b] (pads: positions < 0). The new tokens of a step occupy
slots `slots` ([s] int64, a device tensor, so the decode step has fixed shapes and reads no
host value: CUDA-graph capturable). Query slot i of row b sees key slot j when

    j <= i (causal)  and  j >= pad[b] (not a pad; a pad query sees itself, so no row of the
                                       softmax is empty, and its output is never used)

Positions are per row: learned and rotary positions use i - pad[b]; ALiBi uses the slot
distance i - j, which equals the position distance between two real tokens of a row.

| tensor | shape | meaning |
|---|---|---|
| k[layer], v[layer] | [b, KL, L, d] | this rank's kv heads (KL: its kv groups under tp; GQA: kv heads, never expanded) |
| pad | [b] int64 | left padding of each row |
| mask | [b, 1 or KL, GL s, L] | additive (0 / -inf, + ALiBi) for the GQA-grouped queries (step.py) |

Block-sparse models: query position p sees key position q <= p when the layout of the padded
length L (the total length rounded up to the sparse block, the same layout at every step)
has tile [h, p // block, q // block]; this is the model run on the sequence right-padded to
L, whatever the prompt length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.positions import rope_cos_sin


@dataclass
class StepInputs:
    """What every layer of one forward step shares (built once per step)."""

    slots: torch.Tensor
    """[s] int64: the cache slots of the new tokens."""
    positions: torch.Tensor
    """[b, s] int64: their positions (learned / rotary; pads clamped to 0)."""
    mask: torch.Tensor
    """[b, 1 or KL, GL s, L] additive attention mask in the model dtype."""
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """cos, sin [s, b, d] or None."""


class KVCache:
    """Preallocated keys and values of the layers one rank holds, for `batch` rows of up to
    `length` tokens, and what builds each step's mask and positions from them.

    `attention` is any of the stage's `UlyssesAttention` modules (all layers share head
    layout, positions, ALiBi slopes and sparse pattern); `layers` the global indices held.
    """

    def __init__(self, attention, layers: list[int], pad: torch.Tensor, length: int, *,
                 dtype: torch.dtype, device):
        lay = attention.layout
        self.kv_groups, self.q_per_group = lay.tp_groups
        self.head_dim, self.length = lay.head_dim, length
        self.dtype, self.device = dtype, torch.device(device)
        shape = (pad.shape[0], self.kv_groups, length, self.head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.pad = pad.to(device)
        self.key_slots = torch.arange(length, device=device)
        self.rope_theta = attention.rope_theta if attention.position_embedding == "rope" else None
        self.slopes = attention.slopes(self.device)  # [KL GL] float32 or None
        self.layout = None  # [KL GL, nb, nb] bool over this rank's query heads
        if attention.sparse is not None:
            self.block = attention.sparse.config.block
            self.layout = attention.sparse.layout(length).to(self.device)

    def inputs(self, slots: torch.Tensor) -> StepInputs:
        """The StepInputs of new tokens at `slots` [s] (device int64); no host reads."""
        positions = (slots[None, :] - self.pad[:, None]).clamp_(min=0)  # [b, s]
        rope = None
        if self.rope_theta is not None:
            rope = rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype=self.dtype)
        return StepInputs(slots, positions, self._mask(slots), rope)

    def _mask(self, slots: torch.Tensor) -> torch.Tensor:
        """Additive mask [b, 1 or KL, GL s, L] (module docstring for the rule)."""
        j = self.key_slots[None, None, :]  # [1, 1, L]
        i = slots[None, :, None]  # [1, s, 1]
        pad = self.pad[:, None, None]  # [b, 1, 1]
        heads = ((j <= i) & (j >= pad))[:, None]  # [b, 1, s, L]
        if self.layout is not None:
            heads = heads & self._layout_mask(slots)  # [b, KL GL, s, L]
        heads = heads | ((i < pad) & (j == i))[:, None]  # a pad query sees itself only
        bias = torch.zeros(heads.shape, dtype=torch.float32, device=self.device)
        if self.slopes is not None:
            distance = (i - j).abs().float()  # [1, s, L]
            bias = bias + (-self.slopes[None, :, None, None] * distance[:, None])  # [b, KL GL, s, L]
        bias = bias.masked_fill(~heads, float("-inf")).to(self.dtype)
        b, h, s, length = bias.shape
        if h == 1:  # the same for every head: repeat over the GL queries of a group
            return bias.repeat(1, 1, self.q_per_group, 1)  # [b, 1, GL s, L]
        return bias.view(b, self.kv_groups, self.q_per_group * s, length)  # [b, KL, GL s, L]

    def _layout_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool [b, KL GL, s, L]: the sparse layout at the rows' positions."""
        last = self.layout.shape[-1] - 1
        q_block = ((slots[None, :] - self.pad[:, None]).clamp(min=0) // self.block).clamp(max=last)
        k_block = ((self.key_slots[None, :] - self.pad[:, None]).clamp(min=0) // self.block)
        k_block = k_block.clamp(max=last)  # [b, L]
        table = self.layout[:, q_block[:, :, None], k_block[:, None, :]]  # [h, b, s, L]
        return table.permute(1, 0, 2, 3)
