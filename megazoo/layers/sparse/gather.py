"""Block-sparse attention over gathered keys: the plan of `gather_plan.py` run as one
FlexAttention call (whose 128 x 128 tiles are mostly full) plus one over the dense rows, or,
computing the same function, as float32 math with the plan's mask (CPU, checks).

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries |
| k, v | [s, b, hk, d] | keys / values (GQA: hq % hk == 0) |
| keys, values | [b, hq or hk, K, d] | gathered along the plan's key axis (hk when heads share the plan) |
| q_rows | [b, hq, R, d] | the dense rows' queries |
| out | [s, b, hq, d] | attention output; a dense row's output comes from the rows call |

Exact: every (query, key) pair of the layout is scored once (by the owner rule of
`gather_plan.py`), so the softmax over the gathered keys is the layout's softmax; gradients
flow through the gathers (index_select / index_copy). A plan with rectangles
(`rects.py`) leaves the covered (query chunk, shared key tile) pairs out of the
FlexAttention call and merges a dense kernel's rectangles in by log-sum-exp
(`merge.py`); without ALiBi only (a dense kernel has no cheap position bias).
"""
from __future__ import annotations

import torch

from .. import attention_kernels as kernels
from .gather_plan import PRIVATE, PRIVATE_BASE, ROW, GatherPlan
from .merge import merge_rects, rect_kernel
from .rects import RectPlan, flex_tiles
from .tiles import TILE, tile_block_mask


def _head(h, table: torch.Tensor):
    """Index of head h into a per-head table, or 0 where all heads share one row."""
    return h * 0 if table.shape[0] == 1 else h


def main_mask_mod(plan: GatherPlan, rects: RectPlan | None = None):
    """mask_mod(b, h, q, i): query q sees gathered key i (the plan's owner rule), and, given
    rectangles, the pair is not in one of them (chunk q // C, key tile i // TILE)."""
    owner, pos, code = plan.owner, plan.key_pos, plan.key_code
    block, causal, last = plan.block, plan.causal, owner.shape[-1] - 1
    covered = None if rects is None else rects.covered
    chunk, last_chunk = (1, 0) if rects is None else (rects.chunk, covered.shape[0] - 1)

    def mask_mod(b, h, q_idx, kv_idx):
        hh = _head(h, owner)
        p, c = pos[hh, kv_idx], code[hh, kv_idx]
        own = owner[hh, torch.clamp(q_idx // block, max=last), p // block]
        private = (own == PRIVATE) & (c - PRIVATE_BASE == q_idx // TILE)
        seen = torch.where(c >= PRIVATE_BASE, private, own == c)
        if covered is not None:
            seen = seen & ~covered[torch.clamp(q_idx // chunk, max=last_chunk), kv_idx // TILE]
        return seen & (p <= q_idx) if causal else seen
    return mask_mod


def rows_mask_mod(plan: GatherPlan):
    """mask_mod(b, h, j, kv): the j-th dense-row query sees key kv."""
    owner, rows, dst = plan.owner, plan.row_pos, plan.row_dst
    block, causal, s = plan.block, plan.causal, plan.seq_len

    def mask_mod(b, h, q_idx, kv_idx):
        hh = _head(h, owner)
        p = rows[hh, q_idx]
        seen = (owner[hh, p // block, kv_idx // block] == ROW) & (dst[hh, q_idx] < s)
        return seen & (kv_idx <= p) if causal else seen
    return mask_mod


def block_masks(plan: GatherPlan, rects: bool = False):
    """(main, rows) FlexAttention BlockMasks of a plan (rows None without dense rows), built
    once and kept on the plan; rects: the main mask leaves the plan's rectangles out."""
    plan.masks = {} if plan.masks is None else plan.masks
    if rects in plan.masks:
        return plan.masks[rects]
    s, rect_plan = plan.seq_len, plan.rects if rects else None
    main = tile_block_mask(*flex_tiles(plan, rect_plan), main_mask_mod(plan, rect_plan),
                           (s, plan.key_pos.shape[1]))
    rows = None
    if plan.row_pos is not None:
        rows = tile_block_mask(plan.row_partial, plan.row_full, rows_mask_mod(plan),
                               (plan.row_pos.shape[1], s))
    plan.masks[rects] = (main, rows)
    return plan.masks[rects]


def _gather(x: torch.Tensor, index: torch.Tensor, heads: int, in_place: int = 0):
    """x [b, hx, L, d] at positions index [hp, n] -> ([b, hx or heads, n, d], grouped):
    one index row for all heads keeps hx (GQA stays grouped); per-head rows expand x to
    `heads` first (query head h reads kv head h // (heads / hx)). The first `in_place`
    positions are 0, 1, ... (zero past L): copied in one piece, so only the rest is gathered
    (whose backward adds with atomics)."""
    head = x
    if index.shape[0] > 1 and x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    b, hx, length, d = x.shape
    rest = index[:, in_place:]
    if index.shape[0] == 1:
        picked = x.index_select(2, rest[0])
    else:
        flat = (rest + torch.arange(heads, device=index.device)[:, None] * length).flatten()
        picked = x.reshape(b, heads * length, d).index_select(1, flat).view(b, heads, -1, d)
    if in_place:  # one copy: [x | zeros up to in_place | picked]
        picked = torch.cat([x, x.new_zeros(b, hx, in_place - length, d), picked], dim=2)
    return picked, index.shape[0] == 1 and head.shape[1] != heads


def _put_rows(out: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """out [b, h, s, d] with rows [b, h, R, d] written at dst [hp, R] (padding: slot s,
    appended and dropped, so its gradient is zero)."""
    b, h, s, d = out.shape
    ext = torch.cat([out, out.new_zeros(b, h, 1, d)], dim=2)
    if dst.shape[0] == 1:
        return ext.index_copy(2, dst[0], rows)[:, :, :s]
    flat = (dst + torch.arange(h, device=dst.device)[:, None] * (s + 1)).flatten()
    ext = ext.reshape(b, h * (s + 1), d).index_copy(1, flat, rows.reshape(b, -1, d))
    return ext.view(b, h, s + 1, d)[:, :, :s]


def dense_mask(mask_mod, hp: int, n_q: int, n_k: int, device) -> torch.Tensor:
    """Bool [hp, n_q, n_k]: a mask_mod evaluated everywhere (the math path's mask)."""
    h = torch.arange(hp, device=device)[:, None, None]
    q = torch.arange(n_q, device=device)[None, :, None]
    k = torch.arange(n_k, device=device)[None, None, :]
    return mask_mod(None, h, q, k).expand(hp, n_q, n_k)


def masked_math(q, k, v, mask, scale, slopes, q_pos, k_pos, grouped, return_lse=False):
    """Float32 softmax attention on [b, h, n, d] with a bool mask [hp, n_q, n_k] and ALiBi at
    the tokens' positions ([hp, n] tables); a query that sees no key outputs 0 (lse -inf).
    return_lse: (out, float32 lse [b, h, n_q])."""
    qf, kf, vf = q.float(), k.float(), v.float()
    if grouped:
        kf, vf = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (kf, vf))
    scores = qf @ kf.transpose(-1, -2) * scale  # [b, hq, n_q, n_k]
    if slopes is not None:
        dist = (q_pos[:, :, None] - k_pos[:, None, :]).abs()  # [hp, n_q, n_k]
        scores = scores - slopes.float()[:, None, None] * dist
    scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1) * mask.any(-1, keepdim=True)
    if not return_lse:
        return (probs @ vf).to(q.dtype)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~mask.any(-1), float("-inf"))
    return (probs @ vf).to(q.dtype), lse


def gather_attention(q, k, v, plan: GatherPlan, *, scale: float, alibi_slopes=None,
                     kernel: str = "flex") -> torch.Tensor:
    """Attention of the plan's layout (module docstring: shapes). kernel: "flex"
    (FlexAttention, compiled on CUDA, forward only on CPU) or "math" (float32, an explicit
    [hp, s, K] mask; rectangles on the float32 kernel); the BlockMasks are built on first use
    and kept on the plan. The plan's rectangles run when no ALiBi is given."""
    s, hq = q.shape[0], q.shape[2]
    rects = plan.rects if alibi_slopes is None else None
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    keys, grouped = _gather(kb, plan.key_pos, hq, plan.direct_len)
    values, _ = _gather(vb, plan.key_pos, hq, plan.direct_len)
    seq = torch.arange(s, device=q.device)[None]
    if kernel == "flex":
        main_mask, rows_mask = block_masks(plan, rects is not None)
        out = kernels.flex_at_positions(qb, keys, values, main_mask, alibi_slopes, seq,
                                        plan.key_pos, scale, grouped, rects is not None)
    else:
        mask = dense_mask(main_mask_mod(plan, rects), plan.heads, s, plan.key_pos.shape[1],
                          q.device)
        out = masked_math(qb, keys, values, mask, scale, alibi_slopes, seq, plan.key_pos, grouped,
                    rects is not None)
    if rects is not None:
        part = slice(rects.start, plan.key_pos.shape[1])  # segment 2 on: the rectangles' keys
        kind = "math" if kernel == "math" else rect_kernel(q)
        out = merge_rects(qb, keys[:, :, part], values[:, :, part], *out, rects, scale, kind)
    if plan.row_pos is not None:
        q_rows, _ = _gather(qb, plan.row_pos, hq)
        grouped = hq != kb.shape[1]
        if kernel == "flex":
            rows = kernels.flex_at_positions(q_rows, kb, vb, rows_mask, alibi_slopes,
                                             plan.row_pos, seq, scale, grouped)
        else:
            mask = dense_mask(rows_mask_mod(plan), plan.heads, plan.row_pos.shape[1], s, q.device)
            rows = masked_math(q_rows, kb, vb, mask, scale, alibi_slopes, plan.row_pos, seq,
                               grouped)
        out = _put_rows(out, rows, plan.row_dst)
    return out.permute(2, 0, 1, 3)  # [s, b, hq, d]
