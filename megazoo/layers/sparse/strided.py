"""Strided global columns: a causal layout whose global keys repeat in every window (the
fixed mode, as the seeds' section draws it) computed as one dense causal kernel call and a
small FlexAttention call, merged exactly by log-sum-exp.

The layout: windows of W tokens; every query sees its own window up to itself, and the g
global tokens of every earlier window (the same offsets in each window; per head they may
differ). Gather the global tokens in order, so window a's are keys [g a, g a + g). Query p
(window a, offset o = p mod W) sees gathered keys j < g a. With R = W / g and p = R m + r,
m = g a + t where t = o // R is in [0, g): among the queries of one residue r, in order of
m, the causal mask shifted by g (j <= m - g) holds every gathered key p sees except the
previous window's of rank u > t, and no key p does not see. Hence

1. global part: the R residues' queries (a strided view of q: no copy) but the first g
   (window 0 has no earlier window), against the gathered keys but the last g, under a plain
   square causal mask: R batch entries of one dense causal kernel call (cuDNN), which runs
   at dense attention's rate over 1 / R of the causal triangle;
2. local part (FlexAttention, 128-tiles near the diagonal): the own window up to the query,
   and the previous window's global keys of rank u > t (what the shift leaves out);
3. the two merged by log-sum-exp; in the backward the dense kernel gets the merged output
   and log-sum-exp, so its own backward returns exactly its part's gradients, and the
   FlexAttention part gets (w dO, w (rowsum(dO * out_f) - D)) as `merge.py` derives.

On CUDA with Triton, below block 128, `blocks.strided_blocks_attention` runs steps 2
and 3 in the Triton kernel instead (the merge and the gradient sums inside it); this module's
FlexAttention version serves block 128 (where FlexAttention's tiles fit the windows) and
machines without Triton, and its float32 version the CPU checks.

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries |
| k, v | [s, b, hk, d] | keys / values (GQA: hq % hk == 0) |
| key_pos | int64 [hp, L] | positions of the gathered global keys, L = s / R - g (hp = 1: heads share) |
| rank | int64 [hp, W] | rank of each window offset among the window's global tokens, -1 if not global |
| keys, values | [R b, hq, L, d] | the gathered keys, expanded to the R residues and the query heads |
| out | [s, b, hq, d] | attention output |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import attention_kernels as kernels
from .gather import dense_mask, masked_math
from .merge import compiled, flex_grads, merge_parts, rect_backward, rect_forward, rect_kernel
from .tiles import TILE, tile_block_mask


@dataclass
class StridedPlan:
    """A layout recognised as strided global columns (module docstring: fields)."""

    window: int
    ratio: int
    per_window: int
    rank: torch.Tensor
    key_pos: torch.Tensor
    mask: object = None  # the local part's FlexAttention BlockMask, built on first use
    local: object = None  # its Triton kernel's lists (`blocks.strided_local`)

    @property
    def seq_len(self) -> int:
        return (self.key_pos.shape[1] + self.per_window) * self.ratio

    def block_mask(self):
        """The local part's FlexAttention BlockMask (built on first use, kept on the plan)."""
        if self.mask is None:
            partial, full = _local_tiles(self, self.seq_len)

            def mask_mod(b, h, q_idx, kv_idx):
                return local_visible(self, h, q_idx, kv_idx)
            self.mask = tile_block_mask(partial, full, mask_mod, (self.seq_len,) * 2)
        return self.mask


def _window_blocks(lay: torch.Tensor) -> int | None:
    """w, the window in blocks, read off one head's causal layout [nb, nb]: a column that is
    not global is seen down to its window's last row; None if every column reaches the end."""
    nb = lay.shape[0]
    last = (lay * torch.arange(1, nb + 1, device=lay.device)[:, None]).amax(0) - 1  # per column
    local = last[last < nb - 1]
    return int(local.min()) + 1 if local.numel() else None


def _synthesised(glob: torch.Tensor, nb: int, w: int) -> torch.Tensor:
    """The causal layout [hp, nb, nb] of windows of w blocks whose blocks at glob [hp, w]
    every later window sees."""
    win = torch.arange(nb, device=glob.device) // w
    seen = glob[:, torch.arange(nb, device=glob.device) % w]  # [hp, nb] (columns)
    rows = (win[:, None] == win[None, :])[None] | (seen[:, None, :] & (win[None, :] < win[:, None])[None])
    return rows & torch.ones(nb, nb, dtype=torch.bool, device=glob.device).tril()


def strided_plan(lay: torch.Tensor, block: int, seq_len: int, causal: bool) -> StridedPlan | None:
    """The strided plan of a layout bool [hp, nb, nb], or None where the layout is not
    windows plus the same global blocks in every window, R = W / g is not whole, s is not a
    multiple of R, or there are fewer than two windows (then the general plans serve)."""
    nb = lay.shape[1]
    if not causal or nb < 2:
        return None
    tri = lay & torch.ones(nb, nb, dtype=torch.bool, device=lay.device).tril()
    w = _window_blocks(tri[0])
    if w is None or 2 * w > nb:
        return None
    glob = tri[:, w, :w]  # the blocks of window 0 that window 1's first row sees
    count = int(glob[0].sum())
    if count == 0 or w % count or bool((glob.sum(-1) != count).any()):
        return None
    if any(not torch.equal(_synthesised(glob[h:h + 1], nb, w)[0], tri[h])
           for h in range(glob.shape[0])):
        return None
    if bool((glob == glob[:1]).all()):
        glob = glob[:1]  # every head the same: one table, keys gathered once for all heads
    window, g = w * block, count * block
    ratio = window // g
    if seq_len % ratio or seq_len // ratio <= g:
        return None
    token_glob = glob.repeat_interleave(block, dim=1)  # [hp, W]
    rank = torch.where(token_glob, token_glob.long().cumsum(1) - 1, -1)
    offsets = torch.stack([row.nonzero()[:, 0] for row in token_glob])  # [hp, g]
    j = torch.arange(seq_len // ratio - g, device=lay.device)
    key_pos = (j // g) * window + offsets[:, j % g]
    return StridedPlan(window, ratio, g, rank, key_pos)


def local_visible(plan: StridedPlan, h, q_idx, kv_idx):
    """The local part's mask: own window up to the query, and the previous window's global
    keys of rank above t = (query offset) // R."""
    w = plan.window
    rank = plan.rank[h if plan.rank.shape[0] > 1 else 0, kv_idx % w]
    same = (q_idx // w == kv_idx // w) & (kv_idx <= q_idx)
    return same | ((q_idx // w == kv_idx // w + 1) & (rank > (q_idx % w) // plan.ratio))


def _local_tiles(plan: StridedPlan, s: int):
    """(partial, full) bool [hp, nt, nt]: the 128-tiles the local part touches, and those it
    fills with real tokens."""
    hp, nt, dev = plan.rank.shape[0], -(-s // TILE), plan.rank.device
    partial = torch.zeros(hp, nt, nt, dtype=torch.bool, device=dev)
    full = torch.zeros_like(partial)
    rows = torch.arange(nt, device=dev)
    qi = (rows[:, None] * TILE + torch.arange(TILE, device=dev))[None, :, :, None]
    h = torch.arange(hp, device=dev)[:, None, None, None]
    for back in range(plan.window // TILE + 3):  # key tile = query tile - back
        ki = ((rows - back)[:, None] * TILE + torch.arange(TILE, device=dev))[None, :, None, :]
        real = (ki >= 0) & (qi < s) & (ki < s)
        vis = local_visible(plan, h, qi, ki.clamp(min=0)) & real  # [hp, nt, TILE, TILE]
        cols = rows - back
        ok = cols >= 0
        partial[:, rows[ok], cols[ok]] = vis.flatten(2).any(-1)[:, ok]
        full[:, rows[ok], cols[ok]] = vis.flatten(2).all(-1)[:, ok]
    return partial & ~full, full


def gathered_keys(x: torch.Tensor, plan: StridedPlan, heads: int) -> torch.Tensor:
    """x [s, b, hk, d] at the gathered positions, copied for each residue and query head:
    [R b, heads, L, d] (a view of a contiguous [L, R b, heads, d])."""
    s, b, hk, d = x.shape
    pos, ratio, length = plan.key_pos, plan.ratio, plan.key_pos.shape[1]
    if pos.shape[0] == 1:
        picked = x.index_select(0, pos[0])[:, :, :, None].expand(length, b, hk, heads // hk, d)
    else:
        wide = x.repeat_interleave(heads // hk, dim=2)  # per-head positions: query heads first
        picked = wide.gather(0, pos.T[:, None, :, None].expand(length, b, heads, d))
    picked = picked.reshape(length, 1, b, heads, d).expand(length, ratio, b, heads, d)
    return picked.reshape(length, ratio * b, heads, d).permute(1, 2, 0, 3)


def residues(x: torch.Tensor, ratio: int, skip: int) -> torch.Tensor:
    """[s, b, h, ...] -> [R b, h, s / R - skip, ...]: the queries p = R m + r, r-major in the
    batch, m >= skip (a view)."""
    s, b = x.shape[:2]
    view = x.reshape(s // ratio, ratio * b, *x.shape[2:])[skip:]
    return view.movedim(0, 2)


def _rows(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """Inverse of `residues` for the kept rows: [R b, h, n, ...] -> [n R, b, h, ...]."""
    rb, h, n = x.shape[:3]
    return x.movedim(2, 0).reshape(n * ratio, rb // ratio, h, *x.shape[3:])


def _merge(out_f, lse_f, out_g, lse_g, ratio: int):
    """(out [s, b, h, d], lse [s, b, h]): the local part (out_f [b, h, s, d], lse_f [b, h, s];
    finite: each query sees itself) merged (`merge_parts`) with the global part of rows W on."""
    of, lf = out_f.permute(2, 0, 1, 3), lse_f.permute(2, 0, 1)
    og, lg = _rows(out_g, ratio), _rows(lse_g, ratio)
    start = of.shape[0] - og.shape[0]
    tail, lse = merge_parts([of[start:], og], [lf[start:], lg])
    return torch.cat([of[:start], tail]), torch.cat([lf[:start], lse])


class _StridedMerge(torch.autograd.Function):
    """forward: the global part's dense causal kernel merged with the local part; backward:
    module docstring, step 3."""

    @staticmethod
    def forward(ctx, q, keys, values, out_f, lse_f, ratio, skip, scale, kind):
        qr = residues(q, ratio, skip)
        out_g, lse_g, aux = rect_forward(kind, qr, keys, values, scale, causal=True)
        out, lse = compiled(_merge, q.is_cuda)(out_f, lse_f, out_g, lse_g, ratio)
        ctx.save_for_backward(q, keys, values, out_f, lse_f, out, lse)
        ctx.args, ctx.aux = (ratio, skip, scale, kind), aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, keys, values, out_f, lse_f, out, lse = ctx.saved_tensors
        ratio, skip, scale, kind = ctx.args
        dout = dout.contiguous()
        to_bhs = functools.partial(torch.movedim, source=0, destination=2)
        d_out_f, d_lse_f = compiled(flex_grads, q.is_cuda)(
            to_bhs(dout), to_bhs(out), to_bhs(lse), out_f, lse_f)
        res = functools.partial(residues, ratio=ratio, skip=skip)
        gq, gk, gv = rect_backward(kind, res(dout), res(q), keys, values, res(out),
                                   res(lse).contiguous(), ctx.aux, scale, causal=True)
        dq = torch.zeros_like(q)
        dq[dq.shape[0] - gq.shape[2] * ratio:] = _rows(gq, ratio)
        return dq, gk, gv, d_out_f, d_lse_f, None, None, None, None


def strided_attention(q, k, v, plan: StridedPlan, *, scale: float, kernel: str = "flex"):
    """Attention of the plan's layout (module docstring: shapes). kernel: "flex" (local part
    on FlexAttention, global part on cuDNN / flash) or "math" (both float32, written out)."""
    s, hq, hk = q.shape[0], q.shape[2], k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    seq = torch.arange(s, device=q.device)[None]
    if kernel == "flex":
        out_f, lse_f = kernels.flex_at_positions(qb, kb, vb, plan.block_mask(), None, seq,
                                                 seq, scale, hq != hk, return_lse=True)
    else:
        mask = dense_mask(lambda b, h, i, j: local_visible(plan, h, i, j), plan.rank.shape[0], s,
                      s, q.device)
        out_f, lse_f = masked_math(qb, kb, vb, mask, scale, None, seq, seq, hq != hk, True)
    kind = "math" if kernel == "math" else rect_kernel(q)
    keys, values = gathered_keys(k, plan, hq), gathered_keys(v, plan, hq)
    return _StridedMerge.apply(q, keys, values, out_f, lse_f, plan.ratio, plan.per_window,
                               scale, kind)
