"""Chunk rectangles: the part of a gather plan's shared keys (segment 2) that a dense,
mask-free kernel computes, taken out of the FlexAttention call and merged back exactly by
log-sum-exp (`merge.py`).

Segment 2 holds the global columns gathered and sorted by position. Split the queries into
chunks of C rows (C a multiple of TILE). A key tile j of segment 2 is *covered* for chunk c
when every real query of the chunk sees every key of the tile under the plan's owner rule
(SHARED owner, and causality), for every head of the plan: then (chunk c queries) x (tile j
keys) is a dense rectangle with no mask. Each maximal run of covered tiles of a chunk is one
rectangle, one call of cuDNN's (or flash's) non-causal attention; under causality the runs
are the prefix of earlier global columns (K_c keys), bidirectional layouts also get the
columns after the chunk. Heads with their own plans share the rectangles' index ranges, each
over its own gathered keys (a tile covered for every head).

The FlexAttention call keeps everything else (windows, the shared keys outside the runs,
private keys): its mask leaves out the covered (chunk, key tile) pairs and its tile tables
drop them, so every (query, key) pair of the layout is still scored exactly once.

| field | shape | meaning |
|---|---|---|
| chunk | int | C, query rows per chunk |
| covered | bool [nc, K / TILE] | gathered-axis key tiles chunk c computes as rectangles |
| runs | nc tuples of (k0, k1) | the rectangles' key ranges, relative to segment 2's start |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .gather_plan import SHARED, GatherPlan
from .tiles import TILE

CHUNKS = 8  # about this many query chunks per sequence: C = s / CHUNKS rounded to TILE
RECT_SHARE = 0.25  # rectangles are taken when they cover this share of the plan's tiles


@dataclass
class RectPlan:
    """The rectangles of one gather plan (module docstring: fields)."""

    chunk: int
    start: int
    covered: torch.Tensor
    runs: tuple

    def chunks(self, seq_len: int):
        """((q0, q1), runs) of each chunk with at least one rectangle."""
        return [((c * self.chunk, min(seq_len, (c + 1) * self.chunk)), runs)
                for c, runs in enumerate(self.runs) if runs]

    def pairs(self, seq_len: int, heads: int) -> int:
        """(query, key) pairs the rectangles compute, summed over `heads` heads."""
        return heads * sum((q1 - q0) * (k1 - k0) for (q0, q1), runs in self.chunks(seq_len)
                           for k0, k1 in runs)


def chunk_rows(seq_len: int) -> int:
    """C: seq_len / CHUNKS rounded to a multiple of TILE (at least one tile). Fewer, longer
    chunks leave more of segment 2 (the keys between a chunk's start and each query) to
    FlexAttention; more chunks make more kernel calls and add each chunk's key gradients
    into the shared keys' (float32 adds that grow with chunks x shared keys): 8 chunks ran
    the seeds' section faster than 16 or 32 at 32k and 64k (bench/results)."""
    return TILE * max(1, round(seq_len / (CHUNKS * TILE)))


def _seen_entries(plan: GatherPlan):
    """(seen bool [hp, nb, E], E) over the block entries of the gathered axis after segment 1,
    up to the last tile holding a shared key: query block qb sees every token of entry e by
    the SHARED owner (and causality, strictly earlier blocks)."""
    block, dl = plan.block, plan.direct_len
    hp, nb, _ = plan.owner.shape
    shared = plan.key_code[:, dl:] == SHARED  # [hp, K - dl]
    hits = shared.any(0).nonzero()
    width = 0 if hits.numel() == 0 else (int(hits.max()) // TILE + 1) * TILE
    whole = shared[:, :width].view(hp, width // block, block).all(-1)  # [hp, E]
    blk = plan.key_pos[:, dl:dl + width:block] // block  # [hp, E]
    own = plan.owner.gather(2, blk[:, None, :].expand(hp, nb, -1))  # int8 [hp, nb, E]
    seen = (own == SHARED) & whole[:, None, :]
    if plan.causal:
        seen &= blk[:, None, :] < torch.arange(nb, device=blk.device)[None, :, None]
    return seen, width // block


def _runs(row: list) -> tuple:
    """Maximal runs of True in a list of tile flags, as (k0, k1) token ranges."""
    out, begin = [], None
    for j, flag in enumerate(row + [False]):
        if flag and begin is None:
            begin = j
        elif not flag and begin is not None:
            out.append((begin * TILE, j * TILE))
            begin = None
    return tuple(out)


def rect_plan(plan: GatherPlan, chunk: int | None = None) -> RectPlan:
    """The rectangles of a plan with chunks of `chunk` rows (default `chunk_rows`)."""
    chunk = chunk_rows(plan.seq_len) if chunk is None else chunk
    if chunk % TILE or chunk < TILE:
        raise ValueError(f"rectangle chunk must be a positive multiple of {TILE}, got {chunk}")
    block, dl, r = plan.block, plan.direct_len, TILE // plan.block
    hp, nb, _ = plan.owner.shape
    nc, per = -(-plan.seq_len // chunk), chunk // block
    seen, entries = _seen_entries(plan)
    grid = torch.ones(hp, nc * per, entries, dtype=torch.bool, device=seen.device)
    grid[:, :nb] = seen  # query blocks past the sequence impose nothing
    tiles = grid.view(hp, nc, per, entries // r, r).all(4).all(2).all(0)  # [nc, E / r]
    covered = torch.zeros(nc, plan.key_pos.shape[1] // TILE, dtype=torch.bool,
                          device=seen.device)
    covered[:, dl // TILE:dl // TILE + tiles.shape[1]] = tiles
    runs = tuple(_runs(row) for row in tiles.cpu().tolist())
    return RectPlan(chunk, dl, covered, runs)


def add_rects(plan: GatherPlan, chunk: int | None = None,
              min_share: float = RECT_SHARE) -> GatherPlan:
    """Give the plan its rectangles when they cover at least `min_share` of its kernel tiles
    (rectangle pairs / TILE^2 against the plan's partial + full tiles): then most of the
    global-column work runs at the dense kernel's rate, which beats FlexAttention's full
    tiles (~0.7 of cuDNN's rate) by more than the extra calls and the merge cost. Returns the
    plan (unchanged below the share); `gather_attention` runs them when no ALiBi is given."""
    rects = rect_plan(plan, chunk)
    tiles = sum(plan.tiles())
    if tiles and rects.pairs(plan.seq_len, plan.heads) >= min_share * tiles * TILE * TILE:
        plan.rects = rects
        plan.masks = None
    return plan


def flex_tiles(plan: GatherPlan, rects: RectPlan | None):
    """(partial, full) kernel tiles of the FlexAttention call: the plan's, less the tiles the
    rectangles own (query tile t lies in chunk t * TILE // C)."""
    if rects is None:
        return plan.partial, plan.full
    nt = plan.partial.shape[1]
    chunk_of = torch.arange(nt, device=plan.partial.device) * TILE // rects.chunk
    own = rects.covered.to(plan.partial.device)[chunk_of][None]  # [1, nt, K / TILE]
    return plan.partial & ~own, plan.full & ~own
