"""Block-sparse attention layouts: which (query block, key block) tiles each head computes.

`layout(config, num_heads, seq_len, seed)` returns a bool tensor [heads, nb, nb] (nb = s /
block; True = the block x block tile of scores is computed). It is a pure function of its
arguments, so every rank (any tp / Ulysses split) computes the same layout; a rank holding the
global heads [h0, h1) takes rows h0:h1 (`heads=(h0, h1)`). Random blocks come from a generator
seeded by (seed, head), never from global random state.

What each mode draws, per head (DeepSpeed's sparsity configs; r = query block, c = key block):

- dense: every tile.
- fixed (Sparse Transformers): the sequence is cut into windows of num_local_blocks blocks;
  a block sees its window (c <= r when unidirectional). In each window num_global_blocks blocks
  are global, counted from the window's end: head h uses the (h mod
  num_different_global_patterns)-th choice; global columns are seen by every row (rows >= the
  global block when unidirectional), and with horizontal_global_attention global rows see all.
  A short last window still gets its global blocks.
- variable: num_random_blocks random columns per row (from all blocks), local windows of the
  sizes in local_window_blocks (the last repeating), global columns at global_block_indices
  (or the ranges [start, end) with global_block_end_indices), rows too when horizontal.
- bigbird: random columns per row (unidirectional: from blocks <= r), a sliding window
  |r - c| <= num_sliding_window_blocks // 2, and the first num_global_blocks blocks global as
  rows and columns; unidirectional keeps the lower triangle.
- bslongformer: the sliding window, plus global rows and columns at global_block_indices (or
  ranges); unidirectional keeps the lower triangle.

"unidirectional" keeps the lower block triangle (key block <= query block) of what the mode
draws, in every mode, as DeepSpeed documents it ("the upper triangular of the attention matrix
is empty"); DeepSpeed's code left a few tiles above the diagonal (global ranges wider than one
block, variable's random blocks). Within a diagonal tile tokens still see later tokens unless
the attention is causal.

`causal=True` (decoder models) intersects any layout with the block lower triangle (the
attention applies the token-level causality inside diagonal tiles). `megazoo-sparse-layout`
prints a layout's density and draws it.
"""
from __future__ import annotations

import random

import torch

from ...config.sparse_attention import SparseAttentionConfig

__all__ = ["SparseAttentionConfig", "check_sequence", "layout", "density"]


def check_sequence(config: SparseAttentionConfig, seq_len: int) -> int:
    """The number of blocks of a seq_len sequence; a one-line ValueError if the config cannot
    lay it out (length not a multiple of the block, global or window sizes beyond it)."""
    b = config.block
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or seq_len % b:
        raise ValueError(f"sequence length {seq_len} is not a multiple of the sparse attention "
                         f"block {b}; use a sequence length divisible by {b} or another block")
    nb = seq_len // b
    where = f"the {nb} blocks of a {seq_len}-token sequence (block {b})"
    for name in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
        value = getattr(config, name)
        if value is not None and value > nb:
            raise ValueError(f"sparse attention {name}={value} exceeds {where}")
    starts, ends = config.global_block_indices, config.global_block_end_indices
    beyond = [i for i in starts or () if i >= nb] + [e for e in ends or () if e > nb]
    if beyond:
        raise ValueError(f"sparse attention global block index {beyond[0]} is beyond {where}; "
                         f"use indices below {nb} (end indices up to {nb})")
    return nb


def layout(config: SparseAttentionConfig, num_heads: int, seq_len: int, seed: int = 0, *,
           causal: bool = False, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Bool [h1 - h0, nb, nb] (CPU): the tiles heads [h0, h1) of num_heads compute.

    heads defaults to all heads; the result for (h0, h1) equals rows h0:h1 of the full layout.
    When every head has the same pattern the result is an expanded view of one head's (do not
    write into it).
    """
    nb = check_sequence(config, seq_len)
    h0, h1 = (0, num_heads) if heads is None else heads
    if not 0 <= h0 < h1 <= num_heads:
        raise ValueError(f"head range [{h0}, {h1}) is not within the layer's {num_heads} heads")
    heads_drawn = range(h0, h1) if _varies_by_head(config) else range(1)
    bases: dict[int, torch.Tensor] = {}  # the part without random blocks, per global pattern
    out = torch.stack([_head_layout(config, h, nb, seed, bases) for h in heads_drawn])
    if causal or config.attention == "unidirectional":
        out.tril_()  # unidirectional: the lower block triangle of what the mode draws
    return out.expand(h1 - h0, nb, nb)


def density(block_layout: torch.Tensor, block: int, causal: bool) -> float:
    """Fraction of the s x s score matrix computed, counting the token-level causal half of
    diagonal tiles when causal (so dense causal is (s + 1) / 2s)."""
    nb = block_layout.shape[-1]
    tiles = block_layout.sum().item()
    if causal:
        diag = block_layout.diagonal(dim1=-2, dim2=-1).sum().item()
        tokens = (tiles - diag) * block * block + diag * block * (block + 1) / 2
    else:
        tokens = tiles * block * block
    return tokens / (block_layout.shape[0] * (nb * block) ** 2)


def _varies_by_head(c: SparseAttentionConfig) -> bool:
    if not c.different_layout_per_head:
        return False
    if c.mode == "fixed":
        return c.num_different_global_patterns > 1
    return c.mode in ("variable", "bigbird") and c.num_random_blocks > 0


def _head_layout(c: SparseAttentionConfig, h: int, nb: int, seed: int, bases: dict):
    """[nb, nb] bool: head h's tiles before the unidirectional triangle (the module docstring
    says what each mode draws); heads share `bases`, their tiles other than random ones."""
    pattern = h % c.num_different_global_patterns if c.mode == "fixed" else 0
    if pattern not in bases:
        bases[pattern] = _base_layout(c, pattern, nb)
    if c.mode not in ("variable", "bigbird") or c.num_random_blocks == 0:
        return bases[pattern]
    past = c.mode == "bigbird" and c.attention == "unidirectional"
    return bases[pattern] | _random_blocks(nb, c.num_random_blocks, seed, h, within_past=past)


def _base_layout(c: SparseAttentionConfig, h: int, nb: int) -> torch.Tensor:
    if c.mode == "dense":
        return torch.ones(nb, nb, dtype=torch.bool)
    if c.mode == "fixed":
        ids = torch.arange(nb) // c.num_local_blocks
        return _fixed_global(c, h, ids[:, None] == ids[None, :])
    if c.mode == "variable":
        ids = _window_ids(c.local_window_blocks, nb)
        lay = ids[:, None] == ids[None, :]
        for a, b in _global_ranges(c):
            _set_global(lay, a, b, c.horizontal_global_attention)
        return lay
    r = torch.arange(nb)[:, None]
    lay = (r - r.T).abs() <= c.num_sliding_window_blocks // 2  # bigbird, bslongformer
    for a, b in [(0, c.num_global_blocks)] if c.mode == "bigbird" else _global_ranges(c):
        _set_global(lay, a, b, True)
    return lay


def _fixed_global(c: SparseAttentionConfig, h: int, lay: torch.Tensor) -> torch.Tensor:
    nb, w, g = lay.shape[0], c.num_local_blocks, c.num_global_blocks
    first = w - (1 + h % c.num_different_global_patterns) * g  # offset within each window
    end = nb - nb % w  # the whole windows
    for a in range(first, end, w):
        _set_global(lay, a, a + g, c.horizontal_global_attention)
    if end < nb:  # a short last window: its global blocks as far right as fit
        a = max(0, min(end + first, nb - g))
        _set_global(lay, a, a + g, c.horizontal_global_attention)
    return lay


def _set_global(lay: torch.Tensor, a: int, b: int, horizontal: bool) -> None:
    """Blocks [a, b) global: every row sees them; with horizontal they also see every block."""
    lay[:, a:b] = True
    if horizontal:
        lay[a:b, :] = True


def _global_ranges(c: SparseAttentionConfig) -> list[tuple[int, int]]:
    ends = c.global_block_end_indices or [i + 1 for i in c.global_block_indices]
    return list(zip(c.global_block_indices, ends))


def _window_ids(sizes, nb: int) -> torch.Tensor:
    """Window number of each block: windows of sizes[0], sizes[1], ..., then sizes[-1] repeated."""
    ids = torch.empty(nb, dtype=torch.long)
    start, w = 0, 0
    while start < nb:
        size = sizes[min(w, len(sizes) - 1)]
        ids[start:start + size] = w
        start, w = start + size, w + 1
    return ids


def _random_blocks(nb: int, n: int, seed: int, head: int, within_past: bool) -> torch.Tensor:
    """n distinct random key blocks per row (from blocks <= row when within_past, as many as
    exist), drawn by a generator seeded by (seed, head): the same on every rank."""
    lay = torch.zeros(nb, nb, dtype=torch.bool)
    if n == 0:
        return lay
    rng = random.Random(f"megazoo-sparse-layout:{seed}:{head}")
    rows, cols = [], []
    for row in range(nb):
        pool = row + 1 if within_past else nb
        picked = rng.sample(range(pool), min(n, pool))
        rows += [row] * len(picked)
        cols += picked
    lay[rows, cols] = True
    return lay
