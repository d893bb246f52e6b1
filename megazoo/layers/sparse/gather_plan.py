"""A block-sparse layout rearranged so that 128 x 128 kernel tiles are mostly full: the plan
that `gather.py` runs as one FlexAttention call over gathered keys.

FlexAttention skips whole tiles of TILE = 128 queries x 128 keys. A layout of small blocks
(16, 32, 64 tokens) scatters its blocks over many tiles (a 16-token global column, one per 64
tokens, touches half of them), so the kernel's work follows the tiles touched, not the
layout's density. The plan splits every set (query block, key block) of each head into one
of four owners, on the block level:

| owner | which blocks | computed against |
|---|---|---|
| DIRECT | those in "direct" tiles: the diagonal tile, and tiles holding at least r/2 distinct non-global key blocks of the tile row (r = 128 / block): windows | the keys in place (segment 1) |
| SHARED | blocks of global columns (set in at least half of the rows that may see them, and in at least 2r) outside direct tiles | the global columns gathered once per head, sorted by position (segment 2) |
| PRIVATE | every other block (random blocks, stray window ends) | per query tile, its own key blocks gathered into whole tiles (segment 3) |
| ROW | all blocks of dense rows (a row that sees at least half of the blocks it may see, and at least 4r of them: global rows) | a second call over gathered query rows |

The gathered key axis is [segment 1: the s keys, padded to tiles | segment 2 | segment 3];
each key of it has a position (`key_pos`) and a code (`key_code`): DIRECT / SHARED, PRIVATE_BASE
+ the query tile it serves, or NEVER (padding). Query q sees gathered key i when the owner of
(q // block, key_pos[i] // block) is the owner named by the code (for PRIVATE: and q's tile is
the one served) and, if causal, key_pos[i] <= q; so every (query, key) pair of the layout is
computed exactly once. Global columns sorted by position make a causal prefix per query
tile: whole tiles computed without a mask ("full").

| tensor | shape | meaning |
|---|---|---|
| owner | int8 [hp, nb, nb] | owner of each block (0: not in the layout); hp = 1 when heads share it |
| key_pos, key_code | int64 / int32 [hp, K] | gathered keys (K a multiple of 128) |
| partial, full | bool [hp, nt, K / 128] | kernel tiles (nt = ceil(s / 128)) with / without the mask |
| row_pos | int64 [hp, R] | query positions of the dense rows (R a multiple of 128; padding 0) |
| row_dst | int64 [hp, R] | where their outputs go (padding: s, a discarded slot) |
| row_partial, row_full | bool [hp, R / 128, nt] | their kernel tiles over the s keys |

s need not be a multiple of the block: the layout has nb = ceil(s / block) blocks and the
last one is short (its tokens beyond s are never seen, and tiles holding them never full).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tiles import TILE, zero_pad

NONE, DIRECT, SHARED, PRIVATE, NEVER, ROW = 0, 1, 2, 3, 4, 5
PRIVATE_BASE = 8  # key_code of a private key: PRIVATE_BASE + the query tile it serves


@dataclass
class GatherPlan:
    """One layout's gathered keys, dense rows and kernel tiles (module docstring: shapes)."""

    block: int
    seq_len: int
    causal: bool
    owner: torch.Tensor
    key_pos: torch.Tensor
    key_code: torch.Tensor
    partial: torch.Tensor
    full: torch.Tensor
    row_pos: torch.Tensor | None
    row_dst: torch.Tensor | None
    row_partial: torch.Tensor | None
    row_full: torch.Tensor | None
    rects: object | None = None
    """The chunk rectangles over segment 2 (`rects.RectPlan`) that run on a dense
    kernel, or None: everything in the FlexAttention call (`rects.add_rects` sets it)."""
    masks: dict | None = None
    """The FlexAttention BlockMasks (`gather.block_masks`), once built, by whether the
    rectangles are left out."""

    @property
    def heads(self) -> int:
        return self.owner.shape[0]

    @property
    def direct_len(self) -> int:
        """Length of segment 1: the keys in place (positions 0, 1, ..., padded to tiles)."""
        return self.partial.shape[1] * TILE

    def gathered_tiles(self) -> int:
        """Kernel tiles of keys copied out of place (segments 2 and 3), summed over heads."""
        return (self.key_pos.shape[1] - self.direct_len) // TILE * self.heads

    def tiles(self) -> tuple[int, int]:
        """(partial, full) kernel tiles computed, summed over the plan's heads."""
        p, f = int(self.partial.sum()), int(self.full.sum())
        if self.row_pos is not None:
            p, f = p + int(self.row_partial.sum()), f + int(self.row_full.sum())
        return p, f


def build_plan(block_layout: torch.Tensor, block: int, seq_len: int, causal: bool) -> GatherPlan:
    """The plan of a layout bool [hp, nb, nb] (nb = ceil(seq_len / block), block dividing
    TILE), on the layout's device; causal intersects it with the block lower triangle."""
    hp, nb, _ = block_layout.shape
    if TILE % block or nb != -(-seq_len // block):
        raise ValueError(f"a gather plan needs a block dividing {TILE} and a layout of "
                         f"ceil({seq_len} / {block}) blocks per side; got block {block}, "
                         f"layout {tuple(block_layout.shape)}")
    lay = block_layout.tril() if causal else block_layout.clone()
    owner = _owners(lay, TILE // block, causal)
    whole = torch.arange(nb, device=lay.device) * block + block <= seq_len  # [nb] not short
    vblock, vcode = _key_blocks(owner, TILE // block)
    key_pos, key_code = _to_tokens(vblock, vcode, block, seq_len)
    partial, full = _main_tiles(owner, vblock, vcode, whole, causal, TILE // block)
    rows = _dense_rows(owner, whole, block, seq_len, causal)
    return GatherPlan(block, seq_len, causal, owner, key_pos, key_code, partial, full, *rows)


def _owners(lay: torch.Tensor, r: int, causal: bool) -> torch.Tensor:
    """int8 [hp, nb, nb]: the owner of every set block (module docstring's table)."""
    hp, nb, _ = lay.shape
    idx = torch.arange(nb, device=lay.device)
    count = lay.sum(-1)  # [hp, nb] blocks per row
    may_see = idx + 1 if causal else torch.full_like(idx, nb)
    dense_row = (2 * count >= may_see) & (count >= 4 * r)
    rest = lay & ~dense_row[:, :, None]
    col_count = rest.sum(1)  # [hp, nb]
    seen_by = nb - idx if causal else torch.full_like(idx, nb)
    global_col = (2 * col_count >= seen_by) & (col_count >= 2 * r)
    nt = -(-nb // r)
    local = zero_pad(rest & ~global_col[:, None, :], nt * r)  # [hp, nt r, nt r]
    distinct = local.view(hp, nt, r, nt, r).any(2).sum(-1)  # [hp, nt, nt] key blocks per tile
    direct_tile = (2 * distinct >= r) | torch.eye(nt, dtype=torch.bool, device=lay.device)
    direct = direct_tile.repeat_interleave(r, 1).repeat_interleave(r, 2)[:, :nb, :nb]
    owner = torch.zeros(hp, nb, nb, dtype=torch.int8, device=lay.device)
    owner[rest & direct] = DIRECT
    owner[rest & ~direct & global_col[:, None, :]] = SHARED
    owner[rest & ~direct & ~global_col[:, None, :]] = PRIVATE
    owner[lay & dense_row[:, :, None]] = ROW
    return owner


def _key_blocks(owner: torch.Tensor, r: int):
    """(block index, code), each [hp, M] (M a multiple of r): segments 1, 2 and 3 of the
    gathered key axis on the block level."""
    hp, nb, _ = owner.shape
    dev, nt = owner.device, -(-nb // r)
    direct = torch.arange(nt * r, device=dev).expand(hp, -1)
    direct_code = torch.where(direct < nb, DIRECT, NEVER)
    shared, real = _selected((owner == SHARED).any(1), r)  # global columns with a shared block
    shared_code = torch.where(real, SHARED, NEVER)
    private, private_code = _private_blocks(owner, r)
    blocks = torch.cat([direct, shared, private], 1)
    codes = torch.cat([direct_code, shared_code, private_code], 1).to(torch.int32)
    return blocks, codes


def _selected(chosen: torch.Tensor, r: int):
    """(index, real), each [hp, W]: per head the indices where chosen [hp, n] is set, ascending,
    then filler indices (real False); W is the largest count rounded up to a multiple of r."""
    count = chosen.sum(1)
    width = -(-int(count.max()) // r) * r if chosen.shape[0] else 0
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)  # chosen ones first
    index = zero_pad(order[:, None, :], 1, max(width, chosen.shape[1]))[:, 0, :width]
    return index, torch.arange(width, device=chosen.device) < count[:, None]


def _private_blocks(owner: torch.Tensor, r: int):
    """Segment 3: per (head, query tile) the key blocks it owns PRIVATE, ascending, each
    tile's list starting on a kernel tile; every head padded to the longest."""
    hp, nb, _ = owner.shape
    nt = -(-nb // r)
    wanted = zero_pad(owner == PRIVATE, nt * r, nb).view(hp, nt, r, nb).any(2)  # [hp, nt, nb]
    count = wanted.sum(-1)  # [hp, nt]
    padded = -(-count // r) * r
    offset = padded.cumsum(1) - padded
    width = int(padded.sum(1).max()) if hp else 0
    h, t, c = wanted.nonzero(as_tuple=True)  # sorted by head, tile, block
    flat_count = count.flatten()
    first = flat_count.cumsum(0) - flat_count  # index of each group's first entry
    rank = torch.arange(h.numel(), device=owner.device) - first[h * nt + t]
    slot = offset[h, t] + rank
    blocks = torch.zeros(hp, width, dtype=torch.long, device=owner.device)
    codes = torch.full((hp, width), NEVER, dtype=torch.long, device=owner.device)
    blocks[h, slot] = c
    codes[h, slot] = PRIVATE_BASE + t
    return blocks, codes


def _to_tokens(vblock: torch.Tensor, vcode: torch.Tensor, block: int, seq_len: int):
    """Block-level key axis -> token-level (key_pos int64, key_code int32), [hp, M * block];
    tokens beyond seq_len (a short last block) and padding get NEVER and position 0."""
    pos = (vblock[:, :, None] * block + torch.arange(block, device=vblock.device)).flatten(1)
    code = vcode.repeat_interleave(block, dim=1)
    code = torch.where(pos >= seq_len, NEVER, code).to(torch.int32)
    return torch.where(code == NEVER, 0, pos), code


def _grid(seen: torch.Tensor, fullable: torch.Tensor, r: int):
    """(partial, full) kernel tiles of a block-level [hp, R, C] membership: full where all r x r
    blocks are seen and fullable, partial where some are seen and the tile is not full."""
    hp, rows, cols = seen.shape
    n, m = -(-rows // r), -(-cols // r)
    seen, fullable = zero_pad(seen, n * r, m * r), zero_pad(fullable, n * r, m * r)
    any_ = seen.view(hp, n, r, m, r).any(4).any(2)
    full = (seen & fullable).view(hp, n, r, m, r).all(4).all(2)
    return any_ & ~full, full


def _main_tiles(owner, vblock, vcode, whole, causal, r):
    """Kernel tiles [hp, nt, M / r] of the gathered key axis: a gathered block is seen by a
    query block when the owner table names the block's segment (and tile, for PRIVATE)."""
    hp, nb, _ = owner.shape
    code = vcode[:, None, :]  # [hp, 1, M]
    safe = vblock.clamp(max=nb - 1)
    own = owner.gather(2, safe[:, None, :].expand(hp, nb, -1))  # int8 [hp, nb, M]
    tile_of_row = (torch.arange(nb, device=owner.device) // r)[None, :, None]
    seen = torch.where(code >= PRIVATE_BASE,
                       (own == PRIVATE) & (code - PRIVATE_BASE == tile_of_row), own == code)
    fullable = whole[:, None] & whole[safe][:, None, :]
    if causal:  # a DIRECT block on the diagonal needs the token-level causal mask
        rows = torch.arange(nb, device=owner.device)[None, :, None]
        fullable = fullable & ((code != DIRECT) | (vblock[:, None, :] < rows))
    return _grid(seen, fullable, r)


def _dense_rows(owner: torch.Tensor, whole: torch.Tensor, block: int, s: int, causal: bool):
    """The dense rows' (row_pos, row_dst, row_partial, row_full): query positions, output slots
    and kernel tiles over the s keys; all None without dense rows."""
    nb, r = owner.shape[1], TILE // block
    is_row = (owner == ROW).any(-1)  # [hp, nb]
    if not is_row.any():
        return None, None, None, None
    rows, real = _selected(is_row, r)  # [hp, Rb]
    pos = (rows[:, :, None] * block + torch.arange(block, device=rows.device)).flatten(1)
    keep = real.repeat_interleave(block, 1) & (pos < s)
    seen = (owner.gather(1, rows[:, :, None].expand(-1, -1, nb)) == ROW) & real[:, :, None]
    fullable = whole[rows][:, :, None] & whole[None, None, :]
    if causal:
        earlier = torch.arange(nb, device=rows.device)[None, None, :] < rows[:, :, None]
        fullable = fullable & earlier
    return (torch.where(keep, pos, 0), torch.where(keep, pos, s), *_grid(seen, fullable, r))
