"""Block-sparse attention over small blocks in Triton: forward, and the backward as a query-side
(dq) and a key-side (dk, dv) kernel (imported only where triton works).

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


@triton.jit
def _tokens(INDEX, N: tl.constexpr, SUB: tl.constexpr):
    """The N token positions of the N / SUB blocks listed at INDEX, in order."""
    blocks = tl.load(INDEX + tl.arange(0, N // SUB))
    return tl.reshape(blocks[:, None] * SUB + tl.arange(0, SUB)[None, :], (N,))


@triton.jit
def _fwd(Q, K, V, O, LSE, COUNT, INDEX, BITS, sq_s, sq_b, sq_h, sk_s, sk_b, sk_h,
         so_s, so_b, so_h, seq_len, heads, group, layout_heads, tiles, chunks, scale_log2,
         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
         CAUSAL: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    tile = (h % layout_heads) * tiles + t
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
        chunk = tile.to(tl.int64) * chunks + c
        cols = _tokens(INDEX + chunk * (BLOCK_N // SUB), BLOCK_N, SUB)
        col_ok = cols < seq_len
        at = kv + cols.to(tl.int64) * sk_s
        k = tl.load(K + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
        ok = (((tl.load(BITS + chunk) >> shift) & 1) != 0) & col_ok[None, :]
        if CAUSAL:
            ok = ok & (rows[:, None] >= cols[None, :])
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
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    tl.store(O + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_s + dim[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * seq_len + rows, lse, mask=row_ok)


@triton.jit
def _dq(Q, K, V, DO, DQ, LSE, DELTA, COUNT, INDEX, BITS, sq_s, sq_b, sq_h, sk_s, sk_b, sk_h,
        seq_len, heads, group, layout_heads, tiles, chunks, scale, scale_log2,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
        CAUSAL: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    tile = (h % layout_heads) * tiles + t
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    lane = tl.arange(0, BLOCK_N)
    dim = tl.arange(0, D)
    row_ok = rows < seq_len
    at_q = b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_s + dim[None, :]
    q = tl.load(Q + at_q, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + at_q, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0)
    kv = b * sk_b + (h // group) * sk_h
    shift = (tl.arange(0, BLOCK_M) // SUB)[:, None] * (BLOCK_N // SUB) + (lane // SUB)[None, :]
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for c in range(0, tl.load(COUNT + tile)):
        chunk = tile.to(tl.int64) * chunks + c
        cols = _tokens(INDEX + chunk * (BLOCK_N // SUB), BLOCK_N, SUB)
        col_ok = cols < seq_len
        at = kv + cols.to(tl.int64) * sk_s
        k = tl.load(K + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
        vt = tl.load(V + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
        ok = (((tl.load(BITS + chunk) >> shift) & 1) != 0) & col_ok[None, :]
        if CAUSAL:
            ok = ok & (rows[:, None] >= cols[None, :])
        p = tl.where(ok, tl.exp2(tl.dot(q, k) * scale_log2 - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    tl.store(DQ + at_q, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, COUNT, INDEX, BITS, sq_s, sq_b, sq_h, sk_s, sk_b,
          sk_h, sg_s, sg_b, sg_h, seq_len, heads, group, layout_heads, tiles, chunks, scale,
          scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          SUB: tl.constexpr, CAUSAL: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    tile = (h % layout_heads) * tiles + t
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
        lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0)
        ok = (((tl.load(BITS + chunk) >> shift) & 1) != 0) & row_ok[None, :]
        if CAUSAL:
            ok = ok & (rows[None, :] >= cols[:, None])
        pt = tl.where(ok, tl.exp2(tl.dot(k, qt) * scale_log2 - lse[None, :]), 0.0)
        dv += tl.dot(pt.to(qt.dtype), tl.trans(dot_))
        dst = pt * (tl.dot(v, dot_) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    at_g = b * sg_b + h * sg_h + cols[:, None].to(tl.int64) * sg_s + dim[None, :]
    tl.store(DK + at_g, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + at_g, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


def _common(q, k, lists, layout_heads):
    s, b, hq, d = q.shape
    count, index, bits = lists
    return dict(seq_len=s, heads=hq, group=hq // k.shape[2], layout_heads=layout_heads,
                tiles=count.shape[1], chunks=bits.shape[2], D=d, SUB=SUB)


def forward(q, k, v, rows, *, block_m, block_n, layout_heads, scale, causal, num_warps=4,
            num_stages=2):
    """(out [s, b, hq, d], lse float32 [b, hq, s]) of the query-side lists `rows`
    (count, index, bits)."""
    s, b, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
    count, index, bits = rows
    _fwd[(count.shape[1], b * hq)](
        q, k, v, out, lse, count, index, bits, *q.stride()[:3], *k.stride()[:3],
        *out.stride()[:3], scale_log2=scale * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, num_warps=num_warps, num_stages=num_stages,
        **_common(q, k, rows, layout_heads))
    return out, lse


def backward(dout, q, k, v, out, lse, rows, cols, *, block_m, block_n, layout_heads, scale,
             causal, num_warps=4, num_stages=2):
    """(dq [s, b, hq, d], dk, dv [s, b, hq, d] per query head) from the query-side lists `rows`
    and the key-side lists `cols`."""
    s, b, hq, d = q.shape
    delta = (dout.float() * out.float()).sum(-1).permute(1, 2, 0).contiguous()
    dout = dout if dout.stride() == q.stride() else dout.contiguous()
    q = q if dout.stride() == q.stride() else q.contiguous()
    dq = torch.empty_like(q)
    shape = dict(BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, num_warps=num_warps,
                 num_stages=num_stages)
    _dq[(rows[0].shape[1], b * hq)](
        q, k, v, dout, dq, lse, delta, *rows, *q.stride()[:3], *k.stride()[:3],
        scale=scale, scale_log2=scale * LOG2E, **shape, **_common(q, k, rows, layout_heads))
    dk = torch.empty(s, b, hq, d, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    _dkdv[(cols[0].shape[1], b * hq)](
        q, k, v, dout, dk, dv, lse, delta, *cols, *q.stride()[:3], *k.stride()[:3],
        *dk.stride()[:3], scale=scale, scale_log2=scale * LOG2E, **shape,
        **_common(q, k, cols, layout_heads))
    return dq, dk, dv

