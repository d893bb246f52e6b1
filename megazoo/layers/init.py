"""Layout-independent initialisation: every weight element is a pure function of
(seed, tensor key, row, column), so a rank computes exactly its slice of the full matrix
without materialising it (the 250k x 14k BLOOM embedding included).

The generator is counter-based (in the spirit of Philox): a 32-bit integer hash of the
element's coordinates gives two 24-bit uniforms, Box-Muller (float32) turns them into a normal sample. All
arithmetic is exact int64 (products stay below 2**63), so results do not depend on how the
matrix is split. Chunked, so temporaries stay small.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements per chunk of temporaries


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """x = (x * c) mod 2**32 in place, for x < 2**32; split so int64 never overflows."""
    hi = torch.mul(x, c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(hi).bitwise_and_(_MASK)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash in place (xorshift-multiply, Wellons' lowbias32 constants)."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def tensor_key(seed: int, name: str) -> int:
    """A 32-bit stream key for one tensor of one seeded model."""
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & _MASK


def _uniform_(h: torch.Tensor) -> torch.Tensor:
    """The top 24 bits of a hash as a float32 uniform in (0, 1)."""
    return (h >> 8).float().add_(0.5).div_(2.0**24)


def normal_block(key: int, rows: range, cols: range, device=None) -> torch.Tensor:
    """Standard normal samples of the full matrix's block [rows, cols], float32."""
    r = torch.arange(rows.start, rows.stop, device=device, dtype=torch.int64)
    c = torch.arange(cols.start, cols.stop, device=device, dtype=torch.int64)
    row_hash = _mix32_(_mix32_(r.bitwise_xor_(key)).bitwise_xor_(0x68E31DA4))
    h = _mix32_((row_hash[:, None] + _mix32_(c)[None, :]).bitwise_and_(_MASK))
    u1 = _uniform_(h)
    u2 = _uniform_(_mix32_(h.bitwise_xor_(0x5BD1E995)))
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2.0 * math.pi).cos_())


@dataclass(frozen=True)
class NormalInit:
    """N(0, std^2) initialisation that fills any slice of a full weight consistently.

    `key` names the stream; two weights with the same seed and key get the same values.
    """

    std: float = 0.02
    seed: int = 0
    key: str = "weight"

    @torch.no_grad()
    def fill_(self, shard: torch.Tensor, row_offset: int = 0, col_offset: int = 0) -> torch.Tensor:
        """Fill `shard` (2-D, or 1-D as one row) with its slice of the full matrix."""
        if shard.device.type == "meta":
            return shard
        view = shard.view(-1, shard.shape[-1]) if shard.dim() != 1 else shard.view(1, -1)
        stream = tensor_key(self.seed, self.key)
        cols = range(col_offset, col_offset + view.shape[1])
        step = max(1, _CHUNK // max(1, view.shape[1]))
        for start in range(0, view.shape[0], step):
            stop = min(start + step, view.shape[0])
            rows = range(row_offset + start, row_offset + stop)
            block = normal_block(stream, rows, cols, device=shard.device)
            view[start:stop].copy_(block.mul_(self.std))
        return shard


def default_init() -> NormalInit:
    """A NormalInit (std 0.02) whose seed is drawn from torch's global generator.

    Every rank seeded alike (torch.manual_seed) draws the same seed, one draw per layer
    whatever the layout, so the layer is layout-independent without the caller naming seeds.
    """
    return NormalInit(seed=int(torch.randint(0, 2**31 - 1, (1,)).item()))


def init_shard_(weight: torch.Tensor, init_method, row_offset: int, col_offset: int) -> None:
    """Initialise a weight shard: NormalInit fills its slice; any other callable gets the shard;
    None means `default_init()`."""
    init_method = init_method or default_init()
    if isinstance(init_method, NormalInit):
        init_method.fill_(weight, row_offset, col_offset)
    elif weight.device.type != "meta":
        with torch.no_grad():
            init_method(weight)
