"""Gradient codecs: tensors <-> the bytes sent, vectorised PyTorch on the input's device (on
GPUs the block codec also as Triton kernels, `BlockCodec.encode_with_error`, and the topk
encoder as one, `TopKCodec.encode_with_error`).

Every codec turns a 2-D tensor `x` [rows, n] (one row per destination, n a multiple of the
block size) into one uint8 row per input row, and back. Rows are independent, so one call
compresses the chunks for every peer of an all-to-all at once.

- `sign` (1 bit): per block of `block` elements, the scale s = mean |x| (the s minimising
  ||x - s sign(x)||^2) and one bit per element (x >= 0), packed 8 per byte.
  Row bytes: n/8 + (n/block) x scale bytes.
- `ternary` (2 bit): per block, the threshold t = 0.7 mean |x| (Ternary Weight Networks'
  rule for a Gaussian-like block), the elements with |x| > t sent as +-s with s the mean |x|
  over them, the rest as 0; two bits per element (0: zero, 1: +s, 2: -s), packed 4 per byte.
  Row bytes: n/4 + (n/block) x scale bytes.
- `topk`: per chunk of `TOPK_CHUNK` (65536) elements the k largest |x| with k =
  ceil(ratio x chunk); values in the wire dtype and the positions as uint16 offsets within
  their chunk (stored as int16 - 32768). The chunk of an offset is implied by its position in
  the row (every chunk sends exactly k), so an index costs 2 bytes instead of int32's 4
  (an int32 index is needed only for absolute positions).
  Row bytes: chunks x k x (value bytes + 2).

Scales and values travel in `wire_dtype` (the input's dtype, or `communication_data_type`);
`decode(encode(x))` is computed from exactly what is sent, so a caller's error feedback
(x - decode(encode(x))) accounts for the rounding of the wire dtype too.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TOPK_CHUNK = 65536
TERNARY_THRESHOLD = 0.7
_SIGN_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)
_TERNARY_SHIFTS = (6, 4, 2, 0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, m] of any dtype -> [rows, m x itemsize] uint8 (a view of the same memory)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, m] uint8 -> [rows, m / itemsize] of `dtype` (copied when misaligned)."""
    flat = b.contiguous().reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).reshape(b.shape[0], -1)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] integer codes < 2**bits -> [rows, n x bits / 8] uint8 (big-end first)."""
    shifts = _SIGN_SHIFTS if bits == 1 else _TERNARY_SHIFTS
    per = len(shifts)
    weights = torch.tensor([1 << s for s in shifts], dtype=torch.int32, device=codes.device)
    grouped = codes.to(torch.int32).reshape(codes.shape[0], -1, per)  # [rows, n/per, per]
    return (grouped * weights).sum(-1).to(torch.uint8)  # int32: CPU's uint8 sum is slow


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [rows, m] uint8 -> [rows, m x 8 / bits] uint8 codes."""
    shifts = _SIGN_SHIFTS if bits == 1 else _TERNARY_SHIFTS
    s = torch.tensor(shifts, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> s) & mask).reshape(packed.shape[0], -1)


class BlockCodec:
    """Sign (bits=1) or ternary (bits=2) with one scale per block; see the module doc.

    `encode_with_error` and `decode_rows` / `decode_sum` are what the reductions call: on
    CUDA tensors they run as Triton kernels (`megazoo.kernels.triton_codec`, one pass each)
    where triton works and the layout allows (a power-of-two block, scales aligned in the
    row), else as the PyTorch code below; `impl` forces one ("triton" / "torch")."""

    def __init__(self, bits: int, block: int, wire_dtype: torch.dtype, impl: str | None = None):
        if bits not in (1, 2) or block < 8 or block % 8:
            raise ValueError(f"need 1 or 2 bits and a block that divides by 8, got {bits}, {block}")
        self.bits, self.block, self.wire_dtype, self.impl = bits, block, wire_dtype, impl

    def row_bytes(self, n: int) -> int:
        scale = self.wire_dtype.itemsize
        return n * self.bits // 8 + (n // self.block) * scale

    def padded(self, k: int) -> int:
        """A row of `k` elements padded to whole blocks."""
        return -(-k // self.block) * self.block

    def counts(self, k: int, device) -> torch.Tensor:
        """Real (unpadded) elements of each block of a padded row of `k`."""
        kb = self.padded(k)
        counts = torch.full((kb // self.block,), float(self.block), device=device)
        counts[-1] = k - (kb // self.block - 1) * self.block
        return counts

    def _kernels(self, t: torch.Tensor, k: int, dtype: torch.dtype):
        """The Triton module when it runs this call (on `t`'s device, values in `dtype`),
        else None (the PyTorch path)."""
        from ..kernels._dispatch import pick, triton_module

        kb, item = self.padded(k), self.wire_dtype.itemsize
        unsupported = None
        if self.block & (self.block - 1) or (kb * self.bits // 8) % item or dtype != torch.float32:
            unsupported = "the Triton codec needs a power-of-two block, aligned scales, fp32 data"
        if pick(t, self.impl, unsupported=unsupported) != "triton":
            return None
        return triton_module("codec")

    def _layout_args(self, k: int) -> dict:
        kb = self.padded(k)
        return {"bits": self.bits, "block": self.block, "wire_dtype": self.wire_dtype,
                "split": kb * self.bits // 8}

    def encode_with_error(self, x: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
        """x, err [rows, k] -> the wire [rows, row_bytes(padded(k))] of x + err; `err` becomes
        x + err minus what the receivers will decode (error feedback)."""
        rows, k = x.shape
        kernels = self._kernels(x, k, x.dtype)
        if kernels is not None:
            return kernels.encode_with_error(x, err, threshold=TERNARY_THRESHOLD,
                                             row_bytes=self.row_bytes(self.padded(k)),
                                             **self._layout_args(k))
        kb = self.padded(k)
        total = x + err
        wire = self.encode(F.pad(total, (0, kb - k)), self.counts(k, x.device))
        torch.sub(total, self.decode(wire, kb, x.dtype)[:, :k], out=err)
        return wire

    def decode_rows(self, b: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
        """[rows, row bytes] -> `out` [rows, k] (contiguous): each row decoded, its padding
        dropped."""
        kernels = self._kernels(b, k, out.dtype)
        if kernels is not None:
            return kernels.decode(b, k, total=False, out=out, **self._layout_args(k))
        return out.copy_(self.decode(b, self.padded(k), out.dtype)[:, :k])

    def decode_sum(self, b: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, row bytes] -> [k]: the sum of the decoded rows, added in row order."""
        kernels = self._kernels(b, k, dtype)
        if kernels is not None:
            return kernels.decode(b, k, total=True, out=None, **self._layout_args(k))
        return self.decode(b, self.padded(k), dtype)[:, :k].sum(0)

    def encode(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [rows, n] (n a multiple of block; padding zeros) -> [rows, row_bytes] uint8.

        `counts` [n / block]: the real (unpadded) elements of each block of a row."""
        rows, n = x.shape
        blocks = x.reshape(rows, n // self.block, self.block)    # [rows, nb, block]
        mag = blocks.abs()
        mean = mag.sum(-1) / counts                                 # [rows, nb]
        if self.bits == 1:
            scale = mean
            codes = (blocks < 0).reshape(rows, n)                   # 0: +s, 1: -s
        else:
            keep = mag > TERNARY_THRESHOLD * mean.unsqueeze(-1)
            scale = (mag * keep).sum(-1) / keep.sum(-1).clamp(min=1)
            codes = (keep * (1 + (blocks < 0))).reshape(rows, n)    # 0, 1: +s, 2: -s
        scale = scale.to(self.wire_dtype)
        return torch.cat([pack_bits(codes, self.bits), as_bytes(scale)], dim=1)

    def decode(self, b: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, row_bytes] uint8 -> [rows, n] of `dtype`."""
        rows, nb = b.shape[0], n // self.block
        split = n * self.bits // 8
        codes = unpack_bits(b[:, :split], self.bits).reshape(rows, nb, self.block)
        scale = from_bytes(b[:, split:], self.wire_dtype).to(dtype)  # [rows, nb]
        if self.bits == 1:
            sign = 1.0 - 2.0 * codes.to(dtype)
        else:
            sign = (codes == 1).to(dtype) - (codes == 2).to(dtype)
        return (sign * scale.unsqueeze(-1)).reshape(rows, n)


class TopKCodec:
    """Per-chunk top-k values and uint16 offsets; see the module doc.

    `encode_with_error` runs as one Triton kernel (`megazoo.kernels.triton_topk`) on fp32
    CUDA tensors where triton works, else as the PyTorch code below; `impl` forces one."""

    def __init__(self, ratio: float, wire_dtype: torch.dtype, impl: str | None = None):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio}")
        self.ratio, self.wire_dtype, self.impl = ratio, wire_dtype, impl

    def shape(self, numel: int) -> tuple[int, int, int]:
        """(chunks, chunk, k) for a flat tensor of `numel` elements."""
        chunk = min(TOPK_CHUNK, numel)
        return -(-numel // chunk), chunk, min(chunk, max(1, math.ceil(self.ratio * chunk)))

    def row_bytes(self, numel: int) -> int:
        chunks, _, k = self.shape(numel)
        return chunks * k * (self.wire_dtype.itemsize + 2)

    def encode_with_error(self, x: torch.Tensor, err: torch.Tensor,
                          weight: torch.Tensor | None = None) -> torch.Tensor:
        """Flat x, err -> the wire [1, row_bytes] (uint8) of x + err; `err` becomes x + err
        minus what the receivers will decode (error feedback), in place.

        `weight` (flat, like x, >= 0): the entries are chosen by |x| x weight instead of |x|;
        what is sent is still the values (the receivers never need the weights). The sum is
        formed in `err` itself and the sent entries are taken out of it by writing at their
        k positions only (what stays is the wire dtype's rounding of them), so besides the
        selection a call makes one pass over the bucket for the sum and one for the scores;
        only the last, partial chunk is padded (a copy of under one chunk)."""
        from ..kernels._dispatch import pick, triton_module

        numel = x.numel()
        chunks, chunk, k = self.shape(numel)
        contiguous = all(t is None or t.is_contiguous() for t in (x, err, weight))
        unsupported = None if contiguous and x.dtype == err.dtype == torch.float32 else \
            "the Triton topk encoder takes contiguous fp32 data and residual"
        if pick(x, self.impl, unsupported=unsupported) == "triton":
            return triton_module("topk").encode_with_error(x, err, weight, chunk=chunk, k=k,
                                                           wire_dtype=self.wire_dtype)
        whole = numel // chunk * chunk
        total = err.add_(x)
        parts = [(total[:whole].view(-1, chunk),
                  None if weight is None else weight[:whole].view(-1, chunk))]
        if whole < numel:
            pad = (0, chunks * chunk - numel)
            parts.append((F.pad(total[whole:], pad).view(1, chunk),
                          None if weight is None else F.pad(weight[whole:], pad).view(1, chunk)))
        values, offsets = [], []
        for rows, w in parts:
            score = rows.abs()
            if w is not None:
                score.mul_(w)
            idx = score.topk(k, dim=1, sorted=False).indices            # [rows, k] int64
            chosen = rows.gather(1, idx)
            sent = chosen.to(self.wire_dtype)
            rows.scatter_(1, idx, chosen - sent.to(rows.dtype))
            values.append(sent.reshape(1, -1))
            offsets.append((idx - 32768).to(torch.int16).reshape(1, -1))
        if whole < numel:
            total[whole:].copy_(parts[-1][0][0, :numel - whole])
        return torch.cat([as_bytes(torch.cat(values, 1)), as_bytes(torch.cat(offsets, 1))], 1)

    def decode_sum_into(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The sum of the decoded rows [peers, row_bytes] written into flat `out`, rows added
        in order from zero (no two indices of one row collide, so every rank gets
        bit-identical sums)."""
        numel, peers = out.numel(), rows.shape[0]
        chunks, chunk, k = self.shape(numel)
        whole = numel // chunk * chunk
        split = chunks * k * self.wire_dtype.itemsize
        values = from_bytes(rows[:, :split], self.wire_dtype).to(out.dtype)
        values = values.view(peers, chunks, k)
        idx = (from_bytes(rows[:, split:], torch.int16).to(torch.int64) + 32768)
        idx = idx.view(peers, chunks, k)
        main, w = out[:whole].view(-1, chunk).zero_(), whole // chunk
        tail = out.new_zeros(1, chunk) if whole < numel else None
        for peer in range(peers):  # a loop over ranks, never over elements
            main.scatter_add_(1, idx[peer, :w], values[peer, :w])
            if tail is not None:
                tail.scatter_add_(1, idx[peer, w:], values[peer, w:])
        if tail is not None:
            out[whole:].copy_(tail[0, :numel - whole])
        return out
