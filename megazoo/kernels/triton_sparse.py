"""Block-sparse attention over small blocks in Triton: forward, and the backward as a query-side
(dq, and D = rowsum(dO * O)) and a key-side (dk, dv) kernel (imported only where triton works).

The work is cut into tiles of BLOCK_M queries; each tile walks a list of chunks of BLOCK_N
keys, a chunk being BLOCK_N / SUB key blocks of SUB tokens from anywhere in the sequence (the
blocks the tile's rows see, in order: `layers.sparse_blocks` builds the lists). A chunk's bits
say which (row block, key block) pairs of it are set: bit `i * (BLOCK_N // SUB) + j` is row
block i of the tile against the chunk's key block j. The key side is the mirror image: tiles of
BLOCK_N keys walking chunks of row blocks, with bit `j * (BLOCK_M // SUB) + i` for key block j
of the tile against the chunk's row block i. So the work follows the layout at SUB-token
granularity (a random 16-token block costs one chunk slot, not a 128 x 128 tile).

The arithmetic is FlashAttention-2's (online softmax in base 2, fp32 accumulation); the
log-sum-exp is returned and taken in natural log. A query seeing no key outputs 0 with
log-sum-exp -inf.

| tensor | shape | meaning |
|---|---|---|
| q, dq, out, dout | [s, b, hq, d] (any strides, d contiguous) | queries and their gradients |
| k, v | [s, b, hk, d] | keys, values (GQA: query head h uses key head h // (hq / hk)) |
| dk, dv | [s, b, hq, d] | per query head; the caller sums a GQA group |
| lse, delta | float32 [b, hq, s] | log-sum-exp; rowsum(dout * out) |
| count | int32 [hp, tiles] | chunks per tile (hp: 1, layout shared by the heads, or hq) |
| index | int32 [hp, tiles, chunks, BLOCK_N / SUB] | key blocks of each chunk |
| bits | int64 [hp, tiles, chunks] | the pairs set, as above |
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 16
LOG2E = 1.4426950408889634
LOG2E_ = tl.constexpr(LOG2E)  # the same inside kernels


@triton.jit
def _tokens(INDEX, N: tl.constexpr, SUB: tl.constexpr):
    """The N token positions of the N / SUB blocks listed at INDEX, in order."""
    blocks = tl.load(INDEX + tl.arange(0, N // SUB))
    return tl.reshape(blocks[:, None] * SUB + tl.arange(0, SUB)[None, :], (N,))


@triton.jit
def _mask(bits, shift, rows, cols, valid, RANK, hl, window, ratio, CAUSAL: tl.constexpr,
          STRIDED: tl.constexpr):
    """The (row, col) pairs of a chunk that count: its bits, `valid`, causality, and for the
    strided plan's local part the previous window's keys of rank above the row's."""
    ok = (((bits >> shift) & 1) != 0) & valid
    if CAUSAL:
        ok = ok & (rows >= cols)
    if STRIDED:
        rank = tl.load(RANK + hl * window + cols % window)
        ok = ok & ((rows // window == cols // window) | (rank > (rows % window) // ratio))
    return ok


@triton.jit
def _program(heads, layout_heads, tiles):
    """(tile index t, batch-head bh, b, h, the head's layout row hl, its list row tile)."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    hl = h % layout_heads
    return t, bh, b, h, hl, hl * tiles + t


@triton.jit
def _key_chunk(K, INDEX, BITS, RANK, chunk, kv, sk_s, rows, shift, dim, seq_len, hl, window,
               ratio, BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr,
               STRIDED: tl.constexpr):
    """One step of a query tile's walk: its keys' offsets, which keys are real, the keys
    transposed [D, BLOCK_N], and the (row, key) pairs that count."""
    cols = _tokens(INDEX + chunk * (BLOCK_N // SUB), BLOCK_N, SUB)
    col_ok = cols < seq_len
    at = kv + cols.to(tl.int64) * sk_s
    k = tl.load(K + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
    ok = _mask(tl.load(BITS + chunk), shift, rows[:, None], cols[None, :], col_ok[None, :],
               RANK, hl, window, ratio, CAUSAL, STRIDED)
    return at, col_ok, k, ok


@triton.jit
def _global_rows(rows, row_ok, b, h, batch, ratio, skip, s_b, s_h, s_m):
    """Offsets of query rows in the strided plan's global part ([R b, h, n, ...] with query
    p = R (m + skip) + r in batch slot r b + b), and which rows it has."""
    m = rows // ratio
    slot = ((rows % ratio) * batch + b).to(tl.int64)
    return slot * s_b + h * s_h + (m - skip).to(tl.int64) * s_m, row_ok & (m >= skip)


@triton.jit
def _fwd(Q, K, V, O, LSE, COUNT, INDEX, BITS, RANK, OG, LG, sq_s, sq_b, sq_h, sk_s, sk_b, sk_h,
         so_s, so_b, so_h, sg_b, sg_h, sg_m, sl_b, sl_h, sl_m, seq_len, batch, heads, group,
         layout_heads, tiles, chunks, window, ratio, skip, scale_log2, D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr,
         STRIDED: tl.constexpr, MERGE: tl.constexpr):
    t, bh, b, h, hl, tile = _program(heads, layout_heads, tiles)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    lane = tl.arange(0, BLOCK_N)
    dim = tl.arange(0, D)
    row_ok = rows < seq_len
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_s + dim[None, :],
                mask=row_ok[:, None], other=0.0)
    kv = b * sk_b + (h // group) * sk_h
    shift = (tl.arange(0, BLOCK_M) // SUB)[:, None] * (BLOCK_N // SUB) + (lane // SUB)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for c in range(0, tl.load(COUNT + tile)):
        at, col_ok, k, ok = _key_chunk(K, INDEX, BITS, RANK, tile.to(tl.int64) * chunks + c, kv,
                                       sk_s, rows, shift, dim, seq_len, hl, window, ratio,
                                       BLOCK_N, SUB, CAUSAL, STRIDED)
        s = tl.where(ok, tl.dot(q, k) * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - base[:, None])
        alpha = tl.exp2(m_i - base)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + at[:, None] + dim[None, :], mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E_, float("-inf"))
    if MERGE:  # the global part's (out, lse) by log-sum-exp
        at_g, has = _global_rows(rows, row_ok, b, h, batch, ratio, skip, sg_b, sg_h, sg_m)
        at_l, _ = _global_rows(rows, row_ok, b, h, batch, ratio, skip, sl_b, sl_h, sl_m)
        og = tl.load(OG + at_g[:, None] + dim[None, :], mask=has[:, None], other=0.0)
        lg = tl.load(LG + at_l, mask=has, other=float("-inf"))
        top = tl.maximum(lse, lg)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_l, w_g = tl.exp(lse - top), tl.exp(lg - top)
        total = tl.where(w_l + w_g > 0, w_l + w_g, 1.0)
        out = (w_l[:, None] * out + w_g[:, None] * og.to(tl.float32)) / total[:, None]
        lse = tl.where(w_l + w_g > 0, top + tl.log(total), float("-inf"))
    tl.store(O + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + dim[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * seq_len + rows, lse, mask=row_ok)


@triton.jit
def _dq(Q, K, V, O, DO, DQ, LSE, DELTA, COUNT, INDEX, BITS, RANK, GQ, sq_s, sq_b, sq_h, sk_s,
        sk_b, sk_h, so_s, so_b, so_h, sg_b, sg_h, sg_m, seq_len, batch, heads, group,
        layout_heads, tiles, chunks,
        window, ratio, skip, scale, scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr, STRIDED: tl.constexpr,
        MERGE: tl.constexpr):
    t, bh, b, h, hl, tile = _program(heads, layout_heads, tiles)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    lane = tl.arange(0, BLOCK_N)
    dim = tl.arange(0, D)
    row_ok = rows < seq_len
    at_q = b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_s + dim[None, :]
    q = tl.load(Q + at_q, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + at_q, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * LOG2E_
    o = tl.load(O + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + dim[None, :],
                mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # D = rowsum(dO * O), for _dkdv too
    tl.store(DELTA + bh.to(tl.int64) * seq_len + rows, delta, mask=row_ok)
    kv = b * sk_b + (h // group) * sk_h
    shift = (tl.arange(0, BLOCK_M) // SUB)[:, None] * (BLOCK_N // SUB) + (lane // SUB)[None, :]
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for c in range(0, tl.load(COUNT + tile)):
        at, col_ok, k, ok = _key_chunk(K, INDEX, BITS, RANK, tile.to(tl.int64) * chunks + c, kv,
                                       sk_s, rows, shift, dim, seq_len, hl, window, ratio,
                                       BLOCK_N, SUB, CAUSAL, STRIDED)
        vt = tl.load(V + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
        p = tl.where(ok, tl.exp2(tl.dot(q, k) * scale_log2 - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    dq = dq * scale
    if MERGE:  # plus the global part's dq
        at_g, has = _global_rows(rows, row_ok, b, h, batch, ratio, skip, sg_b, sg_h, sg_m)
        dq += tl.load(GQ + at_g[:, None] + dim[None, :], mask=has[:, None],
                      other=0.0).to(tl.float32)
    tl.store(DQ + at_q, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, COUNT, INDEX, BITS, RANK, GK, GV, sq_s, sq_b, sq_h,
          sk_s, sk_b, sk_h, sg_s, sg_b, sg_h, sgk_b, sgk_h, sgk_m, sgv_b, sgv_h, sgv_m, seq_len,
          batch, heads, group, layout_heads, tiles, chunks, window, ratio, skip, glen, scale,
          scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr,
          STRIDED: tl.constexpr, MERGE: tl.constexpr):
    t, bh, b, h, hl, tile = _program(heads, layout_heads, tiles)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, BLOCK_M)
    dim = tl.arange(0, D)
    col_ok = cols < seq_len
    at_k = b * sk_b + (h // group) * sk_h + cols[:, None].to(tl.int64) * sk_s + dim[None, :]
    k = tl.load(K + at_k, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + at_k, mask=col_ok[:, None], other=0.0)
    qo = b * sq_b + h * sq_h
    shift = (tl.arange(0, BLOCK_N) // SUB)[:, None] * (BLOCK_M // SUB) + (lane // SUB)[None, :]
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for c in range(0, tl.load(COUNT + tile)):
        chunk = tile.to(tl.int64) * chunks + c
        rows = _tokens(INDEX + chunk * (BLOCK_M // SUB), BLOCK_M, SUB)
        row_ok = rows < seq_len
        at = qo + rows.to(tl.int64) * sq_s
        qt = tl.load(Q + at[None, :] + dim[:, None], mask=row_ok[None, :], other=0.0)
        dot_ = tl.load(DO + at[None, :] + dim[:, None], mask=row_ok[None, :], other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * LOG2E_
        delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0)
        ok = _mask(tl.load(BITS + chunk), shift, rows[None, :], cols[:, None], row_ok[None, :],
                   RANK, hl, window, ratio, CAUSAL, STRIDED)
        pt = tl.where(ok, tl.exp2(tl.dot(k, qt) * scale_log2 - lse[None, :]), 0.0)
        dv += tl.dot(pt.to(qt.dtype), tl.trans(dot_))
        dst = pt * (tl.dot(v, dot_) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    dk = dk * scale
    if MERGE:  # plus the global part's gradients of the gathered keys, summed over residues
        rank = tl.load(RANK + hl * window + cols % window, mask=col_ok, other=-1)
        j = ((cols // window) * skip + rank).to(tl.int64)
        has = col_ok & (rank >= 0) & (j < glen)
        if tl.max(has.to(tl.int32), 0) > 0:
            for r in range(0, ratio):
                slot = (r * batch + b).to(tl.int64)
                at = slot * sgk_b + h * sgk_h + j * sgk_m
                dk += tl.load(GK + at[:, None] + dim[None, :], mask=has[:, None],
                              other=0.0).to(tl.float32)
                at = slot * sgv_b + h * sgv_h + j * sgv_m
                dv += tl.load(GV + at[:, None] + dim[None, :], mask=has[:, None],
                              other=0.0).to(tl.float32)
    at_g = b * sg_b + h * sg_h + cols[:, None].to(tl.int64) * sg_s + dim[None, :]
    tl.store(DK + at_g, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + at_g, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


def _common(q, k, lists, layout_heads, strided):
    s, b, hq, d = q.shape
    window, ratio = (1, 1) if strided is None else strided[1:]
    return dict(seq_len=s, heads=hq, group=hq // k.shape[2], layout_heads=layout_heads,
                tiles=lists[0].shape[1], chunks=lists[2].shape[2], window=window, ratio=ratio,
                D=d, SUB=SUB, STRIDED=strided is not None)


def forward(q, k, v, rows, *, block_m, block_n, layout_heads, scale, causal, num_warps=4,
            num_stages=2, strided=None, merge=None):
    """(out [s, b, hq, d], lse float32 [b, hq, s]) of the query-side lists `rows`
    (count, index, bits). strided: (rank int32 [hp, W], W, R), the strided plan's local
    part; merge: (out_g [R b, hq, n, d], lse_g [R b, hq, n], skip), its global part, merged."""
    s, b, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
    og, lg, skip = (q[:1, :1], lse[:1, :1], 0) if merge is None else merge
    _fwd[(rows[0].shape[1], b * hq)](
        q, k, v, out, lse, *rows, rows[0] if strided is None else strided[0], og, lg,
        *q.stride()[:3], *k.stride()[:3], *out.stride()[:3], *og.stride()[:3], *lg.stride()[:3],
        batch=b, skip=skip, scale_log2=scale * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, MERGE=merge is not None, num_warps=num_warps, num_stages=num_stages,
        **_common(q, k, rows, layout_heads, strided))
    return out, lse


def backward(dout, q, k, v, out, lse, rows, cols, *, block_m, block_n, layout_heads, scale,
             causal, num_warps=4, num_stages=2, strided=None, merge=None):
    """(dq [s, b, hq, d], dk, dv [s, b, hq, d] per query head) from the query-side lists `rows`
    and the key-side lists `cols`, given the output and log-sum-exp the forward returned.
    strided as in `forward`; merge: (dq_g [R b, hq, n, d], dk_g, dv_g [R b, hq, L, d], skip):
    the global part's gradients, added in (the gathered keys' summed over the residues)."""
    s, b, hq, d = q.shape
    delta = torch.empty_like(lse)
    if dout.stride() != q.stride():
        dout, q = dout.contiguous(), q.contiguous()
    dq = torch.empty_like(q)
    gq, gk, gv, skip = (q[:1, :1], q[:1, :1], q[:1, :1], 0) if merge is None else merge
    shape = dict(BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, MERGE=merge is not None,
                 num_warps=num_warps, num_stages=num_stages, skip=skip, scale=scale,
                 scale_log2=scale * LOG2E)
    rank = rows[0] if strided is None else strided[0]
    _dq[(rows[0].shape[1], b * hq)](
        q, k, v, out, dout, dq, lse, delta, *rows, rank, gq, *q.stride()[:3], *k.stride()[:3],
        *out.stride()[:3], *gq.stride()[:3], batch=b, **shape,
        **_common(q, k, rows, layout_heads, strided))
    dk = torch.empty(s, b, hq, d, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    _dkdv[(cols[0].shape[1], b * hq)](
        q, k, v, dout, dk, dv, lse, delta, *cols, rank, gk, gv, *q.stride()[:3],
        *k.stride()[:3], *dk.stride()[:3], *gk.stride()[:3], *gv.stride()[:3], batch=b,
        glen=gk.shape[2], **shape,
        **_common(q, k, cols, layout_heads, strided))
    return dq, dk, dv
