"""Block-sparse attention over small blocks in Triton: forward, and the backward as a query-side
(dq, and D = rowsum(dO * O)) and a key-side (dk, dv) kernel (imported only where triton works).

The work is cut into tiles of BLOCK_M queries; each tile walks a list of chunks of BLOCK_N
keys, a chunk being BLOCK_N / SUB key blocks of SUB tokens from anywhere in the sequence (the
blocks the tile's rows see, in order: `layers.sparse.blocks` builds the lists and gives SUB).
A chunk's bits say which (row block, key block) pairs of it are set: bit
`i * (BLOCK_N // SUB) + j` is row block i of the tile against the chunk's key block j. The key
side is the mirror image: tiles of BLOCK_N keys walking chunks of row blocks, with bit
`j * (BLOCK_M // SUB) + i` for key block j of the tile against the chunk's row block i. So
the work follows the layout at SUB-token granularity (a random 16-token block costs one chunk
slot, not a 128 x 128 tile).

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

The kernels take their arguments packed: `walk` = (count, index, bits); `sizes` = (seq_len,
batch, heads, group, layout_heads, tiles, chunks); a tensor's strides as one tuple
(s, b, h); `strided` = (rank, window, ratio) for the strided plan's local part and `merge`
its global part's tensors, strides and sizes, both None (and STRIDED / MERGE off) for a plain
layout. The merge in `_fwd` is `layers.sparse.merge.merge_parts` done in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_ = tl.constexpr(LOG2E)  # the same inside kernels
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _tokens(INDEX, N: tl.constexpr, SUB: tl.constexpr):
    """The N token positions of the N / SUB blocks listed at INDEX, in order."""
    blocks = tl.load(INDEX + tl.arange(0, N // SUB))
    return tl.reshape(blocks[:, None] * SUB + tl.arange(0, SUB)[None, :], (N,))


@triton.jit
def _mask(bits, shift, rows, cols, valid, strided, hl, CAUSAL: tl.constexpr,
          STRIDED: tl.constexpr):
    """The (row, col) pairs of a chunk that count: its bits, `valid`, causality, and for the
    strided plan's local part the previous window's keys of rank above the row's."""
    ok = (((bits >> shift) & 1) != 0) & valid
    if CAUSAL:
        ok = ok & (rows >= cols)
    if STRIDED:
        window, ratio = strided[1], strided[2]
        rank = tl.load(strided[0] + hl * window + cols % window)
        ok = ok & ((rows // window == cols // window) | (rank > (rows % window) // ratio))
    return ok


@triton.jit
def _program(sizes):
    """(tile index t, batch-head bh, b, h, the head's layout row hl, its list row tile)."""
    heads, layout_heads, tiles = sizes[2], sizes[4], sizes[5]
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    hl = h % layout_heads
    return t, bh, b, h, hl, hl * tiles + t


@triton.jit
def _offsets(strides, b, h, pos, dim):
    """Offsets [len(pos), D] of rows pos of batch b, head h in a [s, b, h, d] tensor of these
    strides (s, b, h)."""
    return (b * strides[1] + h * strides[2] + pos[:, None].to(tl.int64) * strides[0]
            + dim[None, :])


@triton.jit
def _rows(P, strides, b, h, pos, dim):
    """Pointers to the same rows as `_offsets`, the scalar part added to the pointer first."""
    return (P + b * strides[1] + h * strides[2] + pos[:, None].to(tl.int64) * strides[0]
            + dim[None, :])


@triton.jit
def _key_chunk(K, walk, chunk, kv, sk_s, rows, shift, dim, seq_len, hl, strided,
               BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr,
               STRIDED: tl.constexpr):
    """One step of a query tile's walk: its keys' offsets, which keys are real, the keys
    transposed [D, BLOCK_N], and the (row, key) pairs that count."""
    cols = _tokens(walk[1] + chunk * (BLOCK_N // SUB), BLOCK_N, SUB)
    col_ok = cols < seq_len
    at = kv + cols.to(tl.int64) * sk_s
    k = tl.load(K + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
    ok = _mask(tl.load(walk[2] + chunk), shift, rows[:, None], cols[None, :], col_ok[None, :],
               strided, hl, CAUSAL, STRIDED)
    return at, col_ok, k, ok


@triton.jit
def _global_rows(rows, row_ok, b, h, batch, ratio, skip, slot_stride, head_stride, row_stride):
    """Offsets of query rows in the strided plan's global part ([R b, h, n, ...] with query
    p = R (m + skip) + r in batch slot r b + b, strides (R b, h, n)), and which rows it has."""
    m = rows // ratio
    slot = ((rows % ratio) * batch + b).to(tl.int64)
    at = slot * slot_stride + h * head_stride + (m - skip).to(tl.int64) * row_stride
    return at, row_ok & (m >= skip)


@triton.jit
def _fwd(Q, K, V, O, LSE, walk, sizes, strides, strided, merge, scale_log2, D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr,
         STRIDED: tl.constexpr, MERGE: tl.constexpr):
    """strides: (q, k, out); merge: (out_g, lse_g, their strides, skip)."""
    seq_len, group, chunks = sizes[0], sizes[3], sizes[6]
    t, bh, b, h, hl, tile = _program(sizes)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    lane = tl.arange(0, BLOCK_N)
    dim = tl.arange(0, D)
    row_ok = rows < seq_len
    q = tl.load(_rows(Q, strides[0], b, h, rows, dim), mask=row_ok[:, None], other=0.0)
    kv = b * strides[1][1] + (h // group) * strides[1][2]
    shift = (tl.arange(0, BLOCK_M) // SUB)[:, None] * (BLOCK_N // SUB) + (lane // SUB)[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for c in range(0, tl.load(walk[0] + tile)):
        at, col_ok, k, ok = _key_chunk(K, walk, tile.to(tl.int64) * chunks + c, kv,
                                       strides[1][0], rows, shift, dim, seq_len, hl, strided,
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
        batch, ratio, skip = sizes[1], strided[2], merge[4]
        at_g, has = _global_rows(rows, row_ok, b, h, batch, ratio, skip, merge[2][0],
                                 merge[2][1], merge[2][2])
        at_l, _ = _global_rows(rows, row_ok, b, h, batch, ratio, skip, merge[3][0],
                                 merge[3][1], 1)
        og = tl.load(merge[0] + at_g[:, None] + dim[None, :], mask=has[:, None], other=0.0)
        lg = tl.load(merge[1] + at_l, mask=has, other=float("-inf"))
        top = tl.maximum(lse, lg)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_l, w_g = tl.exp(lse - top), tl.exp(lg - top)
        total = tl.where(w_l + w_g > 0, w_l + w_g, 1.0)
        out = (w_l[:, None] * out + w_g[:, None] * og.to(tl.float32)) / total[:, None]
        lse = tl.where(w_l + w_g > 0, top + tl.log(total), float("-inf"))
    tl.store(_rows(O, strides[2], b, h, rows, dim), out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * seq_len + rows, lse, mask=row_ok)


@triton.jit
def _dq(Q, K, V, O, DO, DQ, LSE, DELTA, walk, sizes, strides, strided, merge, scale, scale_log2,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
        CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MERGE: tl.constexpr):
    """strides: (q and dout and dq, k, out); merge: (dq_g, its strides, skip)."""
    seq_len, group, chunks = sizes[0], sizes[3], sizes[6]
    t, bh, b, h, hl, tile = _program(sizes)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    lane = tl.arange(0, BLOCK_N)
    dim = tl.arange(0, D)
    row_ok = rows < seq_len
    at_q = _offsets(strides[0], b, h, rows, dim)
    q = tl.load(Q + at_q, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + at_q, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * LOG2E_
    o = tl.load(_rows(O, strides[2], b, h, rows, dim), mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # D = rowsum(dO * O), for _dkdv too
    tl.store(DELTA + bh.to(tl.int64) * seq_len + rows, delta, mask=row_ok)
    kv = b * strides[1][1] + (h // group) * strides[1][2]
    shift = (tl.arange(0, BLOCK_M) // SUB)[:, None] * (BLOCK_N // SUB) + (lane // SUB)[None, :]
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for c in range(0, tl.load(walk[0] + tile)):
        at, col_ok, k, ok = _key_chunk(K, walk, tile.to(tl.int64) * chunks + c, kv,
                                       strides[1][0], rows, shift, dim, seq_len, hl, strided,
                                       BLOCK_N, SUB, CAUSAL, STRIDED)
        vt = tl.load(V + at[None, :] + dim[:, None], mask=col_ok[None, :], other=0.0)
        p = tl.where(ok, tl.exp2(tl.dot(q, k) * scale_log2 - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), tl.trans(k))
    dq = dq * scale
    if MERGE:  # plus the global part's dq
        at_g, has = _global_rows(rows, row_ok, b, h, sizes[1], strided[2], merge[2],
                                 merge[1][0], merge[1][1], merge[1][2])
        dq += tl.load(merge[0] + at_g[:, None] + dim[None, :], mask=has[:, None],
                      other=0.0).to(tl.float32)
    tl.store(DQ + at_q, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, walk, sizes, strides, strided, merge, scale,
          scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          SUB: tl.constexpr, CAUSAL: tl.constexpr, STRIDED: tl.constexpr, MERGE: tl.constexpr):
    """strides: (q and dout, k, dk and dv); merge: (dk_g, dv_g, their strides, skip, length)."""
    seq_len, group, chunks = sizes[0], sizes[3], sizes[6]
    t, bh, b, h, hl, tile = _program(sizes)
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, BLOCK_M)
    dim = tl.arange(0, D)
    col_ok = cols < seq_len
    at_k = _offsets(strides[1], b, h // group, cols, dim)
    k = tl.load(K + at_k, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + at_k, mask=col_ok[:, None], other=0.0)
    qo = b * strides[0][1] + h * strides[0][2]
    shift = (tl.arange(0, BLOCK_N) // SUB)[:, None] * (BLOCK_M // SUB) + (lane // SUB)[None, :]
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for c in range(0, tl.load(walk[0] + tile)):
        chunk = tile.to(tl.int64) * chunks + c
        rows = _tokens(walk[1] + chunk * (BLOCK_M // SUB), BLOCK_M, SUB)
        row_ok = rows < seq_len
        at = qo + rows.to(tl.int64) * strides[0][0]
        qt = tl.load(Q + at[None, :] + dim[:, None], mask=row_ok[None, :], other=0.0)
        dot_ = tl.load(DO + at[None, :] + dim[:, None], mask=row_ok[None, :], other=0.0)
        lse = tl.load(LSE + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0) * LOG2E_
        delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0)
        ok = _mask(tl.load(walk[2] + chunk), shift, rows[None, :], cols[:, None],
                   row_ok[None, :], strided, hl, CAUSAL, STRIDED)
        pt = tl.where(ok, tl.exp2(tl.dot(k, qt) * scale_log2 - lse[None, :]), 0.0)
        dv += tl.dot(pt.to(qt.dtype), tl.trans(dot_))
        dst = pt * (tl.dot(v, dot_) - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    dk = dk * scale
    if MERGE:  # plus the global part's gradients of the gathered keys, summed over residues
        dk, dv = _add_gathered(dk, dv, cols, col_ok, b, h, hl, dim, sizes[1], strided, merge)
    at_g = _offsets(strides[2], b, h, cols, dim)
    tl.store(DK + at_g, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + at_g, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _add_gathered(dk, dv, cols, col_ok, b, h, hl, dim, batch, strided, merge):
    """dk, dv plus the strided plan's global-part gradients of the keys among cols that it
    gathered, summed over the R residues (merge: (dk_g, dv_g, strides, strides, skip, L))."""
    window, ratio, skip = strided[1], strided[2], merge[4]
    rank = tl.load(strided[0] + hl * window + cols % window, mask=col_ok, other=-1)
    j = ((cols // window) * skip + rank).to(tl.int64)
    has = col_ok & (rank >= 0) & (j < merge[5])
    if tl.max(has.to(tl.int32), 0) > 0:
        for r in range(0, ratio):
            slot = (r * batch + b).to(tl.int64)
            at = slot * merge[2][0] + h * merge[2][1] + j * merge[2][2]
            dk += tl.load(merge[0] + at[:, None] + dim[None, :], mask=has[:, None],
                          other=0.0).to(tl.float32)
            at = slot * merge[3][0] + h * merge[3][1] + j * merge[3][2]
            dv += tl.load(merge[1] + at[:, None] + dim[None, :], mask=has[:, None],
                          other=0.0).to(tl.float32)
    return dk, dv


def _strides(*tensors) -> tuple:
    """Each tensor's first three strides, as one tuple per tensor."""
    return tuple(tuple(t.stride()[:3]) for t in tensors)


def _shape(q, k, walk, *, block_m, block_n, sub, layout_heads, causal, strided, merge) -> dict:
    """The sizes tuple, the strided group and the compile-time constants of one launch."""
    s, b, hq, d = q.shape
    sizes = (s, b, hq, hq // k.shape[2], layout_heads, walk[0].shape[1], walk[2].shape[2])
    return dict(sizes=sizes, strided=strided, D=d, BLOCK_M=block_m, BLOCK_N=block_n, SUB=sub,
                CAUSAL=causal, STRIDED=strided is not None, MERGE=merge is not None,
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def forward(q, k, v, rows, *, scale, strided=None, merge=None, **launch):
    """(out [s, b, hq, d], lse float32 [b, hq, s]) of the query-side lists `rows`
    (count, index, bits). launch: the plan's tiles (block_m, block_n, sub, layout_heads,
    causal). strided: (rank int32 [hp, W], W, R), the strided plan's local part; merge:
    (out_g [R b, hq, n, d], lse_g [R b, hq, n], skip), its global part, merged."""
    s, b, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
    if merge is not None:  # lse_g's rows travel as unit stride: Triton 3.6 miscompiles a
        og, lg, skip = merge  # nested tuple argument that holds the integer 1
        lg = lg.contiguous()
        merge = (og, lg, _strides(og)[0], lg.stride()[:2], skip)
    _fwd[(rows[0].shape[1], b * hq)](
        q, k, v, out, lse, tuple(rows), strides=_strides(q, k, out), merge=merge,
        scale_log2=scale * LOG2E, **_shape(q, k, rows, strided=strided, merge=merge, **launch))
    return out, lse


def backward(dout, q, k, v, out, lse, rows, cols, *, scale, strided=None, merge=None,
             **launch):
    """(dq [s, b, hq, d], dk, dv [s, b, hq, d] per query head) from the query-side lists `rows`
    and the key-side lists `cols`, given the output and log-sum-exp the forward returned.
    launch and strided as in `forward`; merge: (dq_g [R b, hq, n, d], dk_g, dv_g [R b, hq, L,
    d], skip): the global part's gradients, added in (the gathered keys' summed over the
    residues)."""
    s, b, hq, d = q.shape
    delta = torch.empty_like(lse)
    if dout.stride() != q.stride():
        dout, q = dout.contiguous(), q.contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty(s, b, hq, d, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    q_merge = kv_merge = None
    if merge is not None:
        gq, gk, gv, skip = merge
        q_merge = (gq, _strides(gq)[0], skip)
        kv_merge = (gk, gv, *_strides(gk, gv), skip, gk.shape[2])
    scales = dict(scale=scale, scale_log2=scale * LOG2E)
    _dq[(rows[0].shape[1], b * hq)](
        q, k, v, out, dout, dq, lse, delta, tuple(rows), strides=_strides(q, k, out),
        merge=q_merge, **scales, **_shape(q, k, rows, strided=strided, merge=merge, **launch))
    _dkdv[(cols[0].shape[1], b * hq)](
        q, k, v, dout, dk, dv, lse, delta, tuple(cols), strides=_strides(q, k, dk),
        merge=kv_merge, **scales, **_shape(q, k, cols, strided=strided, merge=merge, **launch))
    return dq, dk, dv
