"""FlexAttention's view of a block-sparse layout: tiles of TILE = 128 queries x 128 keys, each
skipped, computed without a mask ("full") or computed with the layout looked up per element
("partial"), and the BlockMask built from them (`BlockMask.from_kv_blocks`, never by
evaluating a mask over s x s).

| tensor | shape | meaning |
|---|---|---|
| block_layout | bool [h, nb, nb] | the layout (h = 1, or a stride-0 view, when heads share it) |
| partial, full | bool [h, n, n] | tiles with / without the element mask, n = ceil(s / TILE) |
"""
from __future__ import annotations

import torch

TILE = 128  # FlexAttention's tile (its BLOCK_SIZE) on both axes


def zero_pad(x: torch.Tensor, n: int, m: int | None = None) -> torch.Tensor:
    """x [h, a, b] zero-padded to [h, n, m] (m defaults to n)."""
    m = n if m is None else m
    out = torch.zeros(x.shape[0], n, m, dtype=x.dtype, device=x.device)
    out[:, :x.shape[1], :x.shape[2]] = x
    return out


def heads_of(block_layout: torch.Tensor) -> torch.Tensor:
    """The layout with one head when every head shares it (an expanded view), else itself."""
    shared = block_layout.shape[0] == 1 or block_layout.stride(0) == 0
    return block_layout[:1] if shared else block_layout


def token_mask(block_layout: torch.Tensor, block: int) -> torch.Tensor:
    """Bool [h, s, s]: the layout expanded to tokens (no causality); for the dense fallback."""
    return block_layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def _kv_blocks(tiles: torch.Tensor):
    """[h, n, m] bool -> ([1, h, n] counts, [1, h, n, m] column indices, set ones first): the
    form `BlockMask.from_kv_blocks` takes."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None], order.to(torch.int32)[None]


def tile_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod, lengths):
    """The FlexAttention BlockMask over TILE x TILE kernel tiles partial / full [h, n, m]
    (bool: computed with mask_mod / without it) of a (queries, keys) = lengths problem."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(*_kv_blocks(partial), *_kv_blocks(full), BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod, seq_lengths=lengths)


def tile_layout(block_layout: torch.Tensor, block: int, causal: bool,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full), each bool [h, n, n] over kernel tiles (n = ceil(s / TILE)): tiles to
    compute with the element mask, and tiles to compute without it. seq_len: the real length
    s when the last block is short (default: nb * block); a tile holding tokens past it is
    never full."""
    if block % TILE and TILE % block:
        raise ValueError(f"sparse attention block {block} neither divides nor is a multiple of "
                         f"the kernel block {TILE}; use a power of two")
    heads, nb, _ = block_layout.shape
    s = nb * block if seq_len is None else seq_len
    n, r = -(-s // TILE), max(TILE // block, 1)  # r: layout units per tile
    units = token_mask(block_layout, max(block // TILE, 1))  # units of min(block, tile)
    grid = zero_pad(units[:, :n * r, :n * r], n * r).view(heads, n, r, n, r)
    needed, full = grid.any(dim=4).any(dim=2), grid.all(dim=4).all(dim=2)
    inside = torch.arange(1, n + 1, device=block_layout.device) * TILE <= s
    full = full & inside[:, None] & inside[None, :]
    if causal:
        lower = torch.ones(n, n, dtype=torch.bool, device=block_layout.device)
        needed = needed & lower.tril()
        full = full & lower.tril(-1)  # diagonal tiles need the token-level causal mask
    return needed & ~full, full


def _layout_mask_mod(table: torch.Tensor, block: int, causal: bool):
    """mask_mod(b, h, q, kv): table[h, q // block, kv // block] (and q >= kv)."""
    last = table.shape[-1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // block, max=last)  # a padded short tile must not read past it
        kb = torch.clamp(kv_idx // block, max=last)
        seen = table[h, qb, kb]
        return seen & (q_idx >= kv_idx) if causal else seen
    return mask_mod


def block_mask_from_layout(block_layout: torch.Tensor, block: int, *, causal: bool,
                           device=None, seq_len: int | None = None):
    """The FlexAttention BlockMask of a layout (module docstring); build it once per sequence
    length and reuse it. The mask_mod (evaluated in partial tiles, and everywhere by
    FlexAttention's unfused eager path) looks the layout up per block; the compiled kernel
    depends on the table's shape and the block, so layouts of different blocks share one
    when given at one block (`token_mask(layout, block // 16)` at block 16 is the same mask).
    seq_len: the real length when the last block is short (default: nb * block)."""
    device = block_layout.device if device is None else torch.device(device)
    heads = block_layout.shape[0]
    lay = heads_of(block_layout).to(device=device, dtype=torch.bool)
    s = block_layout.shape[1] * block if seq_len is None else seq_len
    partial, full = tile_layout(lay, block, causal, s)
    mask_mod = _layout_mask_mod(lay.expand(heads, -1, -1).contiguous(), block, causal)
    return tile_block_mask(partial.expand(heads, -1, -1), full.expand(heads, -1, -1), mask_mod,
                           (s, s))
