"""Sum-reductions of flat gradient buckets over a group: dense, or compressed with error feedback.

    red = build_reduction("1bit", group, block=1024)       # or "topk" / "2bit" / None (dense)
    pending = red.launch(key, data, shard)                 # starts the first collective (async)
    pending.wait()                                         # `data` (or its `shard`) holds the sum
    red.sent_bytes, red.dense_bytes                        # this rank's bytes since reset_bytes()

`data` is one bucket (flat, its length a multiple of the group size) on this rank; afterwards
it holds the sum over the group's ranks (with `shard`, a view of `data`'s range this rank owns:
only that range is guaranteed, as after a reduce-scatter). `key` names the bucket's
error-feedback state. Every rank gets bit-identical results: each decodes the same bytes and
adds the ranks' contributions in rank order.

Error feedback (1-bit SGD, Seide et al. 2014; 1-bit Adam's compressed all-reduce, Tang et al.
2021): what a rank's compression dropped is kept (`worker` error) and added to its next
input; the servers of the two-phase schemes keep their own (`server` error). Over any number
of steps, sum of outputs + sum of all ranks' errors = sum of all inputs, up to rounding.

- topk: x = data + residual; the chunk-wise top-k (codecs.TopKCodec; optionally chosen by
  |x| x a caller's weight) is all-gathered and every rank adds the ranks' entries in rank
  order; residual = x - sent. Bytes per rank: (n - 1) x row bytes (growing with n).
- 1bit / 2bit: x = data + worker error, cut into n chunks (chunk r for rank r); phase 1
  compresses every chunk and exchanges them with an all-to-all; rank r decodes and adds the n
  versions of its chunk. Phase 2 (skipped with `shard`, where a rank needs only its chunk's
  sum) compresses that sum plus the server error and all-gathers it; everyone decodes all
  chunks. Bytes: (n - 1) x chunk bytes per phase. Only phase 1 is asynchronous.
Dense: all-reduce (reduce-scatter with `shard`), in `wire_dtype` if given
(`communication_data_type`), cast back into `data`. `dense_bytes` counts what an fp32 ring
all-reduce (reduce-scatter) of the same buckets would send.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_flat, reduce_scatter_flat
from .codecs import BlockCodec, TopKCodec


class _Done:
    """A pending reduction: wait for `work` (None: nothing in flight), then run `then`."""

    def __init__(self, work, then=None):
        self.work, self.then = work, then

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.then is not None:
            self.then()
        self.work = self.then = None


class DenseReduction:
    """All-reduce (or reduce-scatter) of the bucket, optionally in another dtype."""

    compressed = False

    def __init__(self, group, wire_dtype: torch.dtype | None = None):
        self.group, self.wire_dtype = group, wire_dtype
        self.sent_bytes = self.dense_bytes = 0
        self.errors: dict[str, torch.Tensor] = {}

    def reset_bytes(self) -> None:
        self.sent_bytes = self.dense_bytes = 0

    def _ring_bytes(self, numel: int, itemsize: int, shard) -> int:
        """What this rank sends in a ring all-reduce (reduce-scatter with `shard`)."""
        n = self.group.size
        return (1 if shard is not None else 2) * (n - 1) * numel * itemsize // n

    def launch(self, key: str, data: torch.Tensor, shard: torch.Tensor | None = None) -> _Done:
        group = self.group.group
        # One rank's sum is its own data: no wire, so no rounding to the wire dtype.
        cast = self.wire_dtype not in (None, data.dtype) and self.group.size > 1
        buf = data.to(self.wire_dtype) if cast else data
        self.sent_bytes += self._ring_bytes(data.numel(), buf.element_size(), shard)
        self.dense_bytes += self._ring_bytes(data.numel(), 4, shard)
        if shard is None:
            work = dist.all_reduce(buf, group=group, async_op=True)
            return _Done(work, (lambda: data.copy_(buf)) if cast else None)
        out = torch.empty(shard.numel(), dtype=buf.dtype, device=buf.device) if cast else shard
        work = reduce_scatter_flat(out, buf, group=group, async_op=True)
        return _Done(work, (lambda: shard.copy_(out)) if cast else None)

    def reset_errors(self) -> None:
        self.errors.clear()


class _Compressed(DenseReduction):
    """Shared bits of the error-feedback reductions: the error buffers, byte counts."""

    compressed = True

    def _error(self, name: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        err = self.errors.get(name)
        if err is None:
            err = self.errors[name] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        return err

    def _gather(self, wire: torch.Tensor) -> tuple[torch.Tensor, object]:
        """All-gather one uint8 row per rank -> ([n, row] tensor, async work)."""
        n = self.group.size
        out = torch.empty(n, wire.numel(), dtype=torch.uint8, device=wire.device)
        self.sent_bytes += (n - 1) * wire.numel()
        work = all_gather_flat(out.view(-1), wire.reshape(-1), group=self.group.group,
                               async_op=True)
        return out, work


class TopKReduction(_Compressed):
    def __init__(self, group, ratio: float, wire_dtype: torch.dtype | None = None,
                 impl: str | None = None):
        super().__init__(group, wire_dtype)
        self.ratio, self.impl = ratio, impl

    def launch(self, key: str, data: torch.Tensor, shard: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> _Done:
        """`weight` (like `data`): choose the entries by |x| x weight
        (`TopKCodec.encode_with_error`)."""
        codec = TopKCodec(self.ratio, self.wire_dtype or data.dtype, self.impl)
        residual = self._error(f"{key}.worker", data, data.numel())
        wire = codec.encode_with_error(data, residual, weight)
        self.dense_bytes += self._ring_bytes(data.numel(), 4, shard)
        rows, work = self._gather(wire)
        return _Done(work, lambda: codec.decode_sum_into(rows, data))


class BlockReduction(_Compressed):
    """1bit (bits=1) or 2bit (bits=2): the two-phase scheme of the module doc."""

    def __init__(self, group, bits: int, block: int, wire_dtype: torch.dtype | None = None,
                 impl: str | None = None):
        super().__init__(group, wire_dtype)
        self.bits, self.block, self.impl = bits, block, impl

    def launch(self, key: str, data: torch.Tensor, shard: torch.Tensor | None = None) -> _Done:
        n, dtype = self.group.size, data.dtype
        codec = BlockCodec(self.bits, self.block, self.wire_dtype or dtype, self.impl)
        k = data.numel() // n
        werr = self._error(f"{key}.worker", data, data.numel())
        wire = codec.encode_with_error(data.view(n, k), werr.view(n, k))   # [n, row]
        recv = torch.empty_like(wire)
        self.sent_bytes += (n - 1) * wire.shape[1]
        self.dense_bytes += self._ring_bytes(data.numel(), 4, shard)
        work = dist.all_to_all_single(recv, wire, group=self.group.group, async_op=True)

        def finish() -> None:
            y = codec.decode_sum(recv, k, dtype)                        # [k]: my chunk's sum
            if shard is not None:
                shard.copy_(y)
                return
            serr = self._error(f"{key}.server", data, k)
            wire2 = codec.encode_with_error(y.view(1, k), serr.view(1, k))
            rows, gather = self._gather(wire2)
            gather.wait()
            codec.decode_rows(rows, k, data.view(n, k))

        return _Done(work, finish)


def build_reduction(algorithm: str | None, group, *, topk_ratio: float = 0.01,
                    block: int = 1024, wire_dtype: torch.dtype | None = None,
                    impl: str | None = None) -> DenseReduction:
    """The reduction for `algorithm` (None / "none": dense) over `group` (a GroupInfo)."""
    if algorithm in (None, "none"):
        return DenseReduction(group, wire_dtype)
    if algorithm == "topk":
        return TopKReduction(group, topk_ratio, wire_dtype, impl)
    if algorithm in ("1bit", "2bit"):
        return BlockReduction(group, int(algorithm[0]), block, wire_dtype, impl)
    raise ValueError(f"gradient compression algorithm must be topk, 1bit or 2bit, got {algorithm!r}")
