"""Triton kernel of the topk codec's encoder (`megazoo.compress.codecs.TopKCodec`).

Imported only where triton works (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    wire = encode_with_error(x, err, weight, chunk=65536, k=656, wire_dtype=torch.float32)

One program per chunk finds the chunk's k-th largest score exactly by radix selection and
writes the chosen entries, in one launch per bucket. The score is |x| (times `weight`), a
non-negative float, so its bits read as an int32 sort like the float; the program walks the
chunk five times:

1. sum: err += x (stored: err is the error-feedback sum from here on), and a histogram of
   the score's bits 30-23;
2. 3. 4. histograms of bits 22-15, 14-7 and 6-0 over the entries whose higher bits equal the
   digits chosen so far; after each, the digit holding the k-th largest is chosen, so after
   the fourth the k-th largest score T is known, and how many entries equal to T to take;
5. compaction: every entry above T, and the first entries equal to T in index order until
   k are taken, is written to the wire (value in the wire dtype, uint16 offset as int16 -
   32768) in index order, and its residual becomes its wire rounding.

The choice is the k largest scores with ties to the lowest index: the same set as torch.topk's
wherever no two scores tie at the k-th largest (torch breaks such ties in no stated order),
and the positions of a padded last chunk score 0, as the eager codec's zero padding does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _score_key(x, W, base, offs, inside, in_chunk, WEIGHTED: tl.constexpr):
    """The score's bits as int32 (>= 0), -1 outside the chunk."""
    score = tl.abs(x)
    if WEIGHTED:
        score = score * tl.load(W + base + offs, mask=inside, other=0.0).to(tl.float32)
    return tl.where(in_chunk, score.to(tl.int32, bitcast=True), -1)


@triton.jit
def _choose(hist, need):
    """The digit whose bin holds the need-th largest entry, and what is still needed of it."""
    bins = tl.arange(0, 256)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # entries in higher bins
    hit = (above < need) & (above + hist >= need)
    return tl.sum(tl.where(hit, bins, 0), 0), need - tl.sum(tl.where(hit, above, 0), 0)


@triton.jit
def _count(digit, match):
    """Histogram (256 bins) of `digit` where `match`: the others are counted into bin 0 and
    taken off it again (cheaper than a histogram with bins for them)."""
    hist = tl.histogram(tl.where(match, digit, 0), 256)
    return hist - tl.where(tl.arange(0, 256) == 0, tl.sum((match == 0).to(tl.int32), 0), 0)


@triton.jit
def _digit_hist(E, W, base, n_valid, chunk, prefix, need, HIGH: tl.constexpr,
                SHIFT: tl.constexpr, TILE: tl.constexpr, WEIGHTED: tl.constexpr):
    """Histogram of bits SHIFT..HIGH-1 over the entries whose bits from HIGH up equal
    `prefix`; returns the chosen digit appended to the prefix and the count still needed."""
    hist = tl.zeros([256], dtype=tl.int32)
    for t in range(0, chunk, TILE):
        offs = t + tl.arange(0, TILE)
        inside = offs < n_valid
        x = tl.load(E + base + offs, mask=inside, other=0.0)
        key = _score_key(x, W, base, offs, inside, offs < chunk, WEIGHTED)
        match = (key >= 0) & ((key >> HIGH) == prefix)
        hist += _count((key >> SHIFT) & ((1 << (HIGH - SHIFT)) - 1), match)
    digit, need = _choose(hist, need)
    return (prefix << (HIGH - SHIFT)) | digit, need


@triton.jit
def _encode_kernel(X, E, W, Vals, Offs, numel, chunk, k, TILE: tl.constexpr,
                   WEIGHTED: tl.constexpr, WIRE: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    base = c * chunk
    n_valid = tl.minimum(numel - base, chunk)
    hist = tl.zeros([256], dtype=tl.int32)
    for t in range(0, chunk, TILE):  # 1. the error-feedback sum, the top digit's histogram
        offs = t + tl.arange(0, TILE)
        inside = offs < n_valid
        x = tl.load(X + base + offs, mask=inside, other=0.0) + \
            tl.load(E + base + offs, mask=inside, other=0.0)
        tl.store(E + base + offs, x, mask=inside)
        key = _score_key(x, W, base, offs, inside, offs < chunk, WEIGHTED)
        hist += _count(key >> 23, key >= 0)
    tl.debug_barrier()
    prefix, need = _choose(hist, k)
    prefix, need = _digit_hist(E, W, base, n_valid, chunk, prefix, need, 23, 15, TILE, WEIGHTED)
    prefix, need = _digit_hist(E, W, base, n_valid, chunk, prefix, need, 15, 7, TILE, WEIGHTED)
    T, need = _digit_hist(E, W, base, n_valid, chunk, prefix, need, 7, 0, TILE, WEIGHTED)
    written = 0
    ties = 0
    for t in range(0, chunk, TILE):  # 5. compaction in index order
        offs = t + tl.arange(0, TILE)
        inside = offs < n_valid
        x = tl.load(E + base + offs, mask=inside, other=0.0)
        key = _score_key(x, W, base, offs, inside, offs < chunk, WEIGHTED)
        equal = (key == T).to(tl.int32)
        take = (key > T) | ((equal == 1) & (ties + tl.cumsum(equal, 0) <= need))
        pos = c * k + written + tl.cumsum(take.to(tl.int32), 0) - 1
        sent = x.to(WIRE)
        tl.store(Vals + pos, sent, mask=take)
        tl.store(Offs + pos, (offs - 32768).to(tl.int16), mask=take)
        tl.store(E + base + offs, x - sent.to(tl.float32), mask=take & inside)
        written += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(equal, 0)


def encode_with_error(x: torch.Tensor, err: torch.Tensor, weight: torch.Tensor | None, *,
                      chunk: int, k: int, wire_dtype: torch.dtype) -> torch.Tensor:
    """Flat fp32 x, err (err updated in place; weight: flat or None) -> the wire [1, row
    bytes] uint8: chunks x k values in `wire_dtype`, then their chunk offsets (int16)."""
    numel = x.numel()
    chunks = triton.cdiv(numel, chunk)
    split = chunks * k * wire_dtype.itemsize
    wire = torch.empty(1, split + chunks * k * 2, dtype=torch.uint8, device=x.device)
    vals, offs = wire[0, :split].view(wire_dtype), wire[0, split:].view(torch.int16)
    _encode_kernel[(chunks,)](x, err, x if weight is None else weight, vals, offs, numel, chunk,
                              k, TILE=1024, WEIGHTED=weight is not None, WIRE=_TL[wire_dtype],
                              num_warps=4)
    return wire
