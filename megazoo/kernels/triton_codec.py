"""Triton kernels of the 1bit / 2bit block codec (`megazoo.compress.codecs.BlockCodec`).

Imported only where triton works (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

| function | reads | writes |
|---|---|---|
| encode_with_error | x [rows, k], err [rows, k] | wire [rows, row bytes]; err = x + err - decoded |
| decode | wire [rows, row bytes] | [rows, k], or with `total` the rows' sum [k] |

One program per (row, block of BLOCK elements): the error-feedback add, the block's scale,
the codes, their bit packing, the decoded value and the new residual happen in registers, so
the encoder reads x and err once and writes err and the wire once. The decoder reads each
row's bytes once; summing, it adds the rows in rank order in registers (every rank runs the
same kernel, so every rank gets the same bits).

Same wire layout and formulas as the PyTorch codec (codes big-end first, 0: +s / 1: -s for
sign; 0: zero, 1: +s, 2: -s for ternary; scales in the wire dtype after the packed codes).
The block mean is summed in another order than torch's, so a scale can differ from the
PyTorch codec's in its last bit; each side's residual is computed from its own scale, so
error feedback conserves the sum exactly either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _encode_kernel(X, E, Codes, Scales, k, row_bytes, scale_stride, scale_start,
                   THRESHOLD: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                   BLOCK: tl.constexpr, WIRE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < k
    x = tl.load(X + row * k + offs, mask=inside, other=0.0).to(tl.float32)
    x += tl.load(E + row * k + offs, mask=inside, other=0.0).to(tl.float32)
    mag = tl.abs(x)
    mean = tl.sum(mag, axis=0) / tl.minimum(k - blk * BLOCK, BLOCK).to(tl.float32)
    negative = (x < 0).to(tl.int32)
    if BITS == 1:
        scale = mean
        code = negative
    else:
        keep = mag > THRESHOLD * mean
        kept = tl.sum(keep.to(tl.float32), axis=0)
        scale = tl.sum(tl.where(keep, mag, 0.0), axis=0) / tl.maximum(kept, 1.0)
        code = tl.where(keep, 1 + negative, 0)
    wire_scale = scale.to(WIRE)
    s = wire_scale.to(tl.float32)
    if BITS == 1:
        decoded = (1 - 2 * code).to(tl.float32) * s
    else:
        decoded = ((code == 1).to(tl.float32) - (code == 2).to(tl.float32)) * s
    tl.store(E + row * k + offs, x - decoded, mask=inside)
    shifts = (PER - 1 - tl.arange(0, PER)) * BITS
    packed = tl.sum(tl.reshape(code, (BLOCK // PER, PER)) << shifts[None, :], axis=1)
    tl.store(Codes + row * row_bytes + blk * (BLOCK // PER) + tl.arange(0, BLOCK // PER),
             packed.to(tl.uint8))
    tl.store(Scales + row * scale_stride + scale_start + blk, wire_scale)


@triton.jit
def _decode_kernel(Codes, Scales, Out, rows, k, row_bytes, scale_stride, scale_start,
                   BITS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr,
                   TOTAL: tl.constexpr):
    blk = tl.program_id(0)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < k
    shifts = (PER - 1 - tl.arange(0, PER)) * BITS
    byte = blk * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    if TOTAL:
        first = 0
        last = rows
    else:
        first = tl.program_id(1)
        last = first + 1
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(first, last):
        packed = tl.load(Codes + r * row_bytes + byte).to(tl.int32)
        code = tl.reshape((packed[:, None] >> shifts[None, :]) & ((1 << BITS) - 1), (BLOCK,))
        s = tl.load(Scales + r * scale_stride + scale_start + blk).to(tl.float32)
        if BITS == 1:
            value = (1 - 2 * code).to(tl.float32) * s
        else:
            value = ((code == 1).to(tl.float32) - (code == 2).to(tl.float32)) * s
        if TOTAL:
            acc += value
        else:
            acc = value
    if TOTAL:
        tl.store(Out + offs, acc, mask=inside)
    else:
        tl.store(Out + tl.program_id(1).to(tl.int64) * k + offs, acc, mask=inside)


def _scales(wire: torch.Tensor, split: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """(the wire as `dtype` elements, elements per row, the first scale's element in a row)."""
    item = dtype.itemsize
    return wire.view(dtype), wire.shape[1] // item, split // item


def encode_with_error(x: torch.Tensor, err: torch.Tensor, *, bits: int, block: int,
                      threshold: float, wire_dtype: torch.dtype, row_bytes: int,
                      split: int) -> torch.Tensor:
    """x, err [rows, k] fp32 (err updated in place) -> wire [rows, row_bytes] uint8."""
    rows, k = x.shape
    wire = torch.empty(rows, row_bytes, dtype=torch.uint8, device=x.device)
    scales, stride, start = _scales(wire, split, wire_dtype)
    grid = (rows, triton.cdiv(k, block))
    _encode_kernel[grid](x, err, wire, scales, k, row_bytes, stride, start, THRESHOLD=threshold,
                         BITS=bits, PER=8 // bits, BLOCK=block, WIRE=_TL[wire_dtype])
    return wire


def decode(wire: torch.Tensor, k: int, *, bits: int, block: int, wire_dtype: torch.dtype,
           split: int, total: bool, out: torch.Tensor | None) -> torch.Tensor:
    """wire [rows, row bytes] -> fp32 [rows, k] (into `out`, contiguous, when given), or
    with `total` the rows' sum [k]."""
    rows = wire.shape[0]
    wire = wire.contiguous()
    if out is None:
        out = torch.empty((k,) if total else (rows, k), dtype=torch.float32, device=wire.device)
    scales, stride, start = _scales(wire, split, wire_dtype)
    grid = (triton.cdiv(k, block),) if total else (triton.cdiv(k, block), rows)
    _decode_kernel[grid](wire, scales, out, rows, k, wire.shape[1], stride, start,
                         BITS=bits, PER=8 // bits, BLOCK=block, TOTAL=total)
    return out
