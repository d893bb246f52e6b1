"""Context parallelism: causal ring attention over a sequence split across the cp ranks, with
the load balancing of mirrored chunks (Liu et al. 2023, ring attention; the chunk pairing of
Megatron-core's context parallelism and Llama 3's training).

The sequence is cut into 2N chunks (N = cp ranks); rank r holds chunks r and 2N-1-r, one
after the other (`context_parallel_chunks`). Key/value blocks (each rank's pair of chunks)
travel around the ring, rank r sending to r+1 and receiving from r-1, the transfer of the next
block overlapped with attention over the current one. At step t rank r holds the block of
rank j = r - t (mod N), and causality leaves exactly half of the work of a full block:

| step | queries | keys / values | mask |
|---|---|---|---|
| t = 0 (own block) | both chunks | both chunks | causal (positions ascend) |
| j < r | both chunks | chunk j (the first) | none |
| j > r | chunk 2N-1-r (the second) | both chunks of j | none |

Partial outputs are merged by their log-sum-exp in float32. Backward walks the ring again:
key/value blocks travel as in forward, and with each block its gradient accumulator (float32),
which every rank adds its share to before passing it on; after N steps each accumulator is back
with its owner. Only the kv heads travel (GQA: never the heads expanded for the queries).

| tensor | shape (cp rank r) |
|---|---|
| q | [n, b, hq, d], n = 2 s / (2N): this rank's two chunks, in order |
| k, v | [n, b, hk, d] |
| out | [n, b, hq, d] |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.layout import context_parallel_chunks
from .groups import Group, group_rank, group_size, process_group
from .ring_kernels import BlockKernel

KV_TAG, GRAD_TAG = 0, 1  # the two kinds of message; a pair of ranks may exchange both at once


def context_parallel_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of cp rank `cp_rank`'s tokens, [seq_len / cp] int64 ascending."""
    first, second = context_parallel_chunks(seq_len, cp, cp_rank)
    return torch.cat([torch.arange(first.start, first.stop, device=device),
                      torch.arange(second.start, second.stop, device=device)])


class _Exchange:
    """One asynchronous ring step: send a tensor to the next rank, receive one like it from
    the previous; `wait()` returns what arrived (the sent tensor is done with then too). A
    ring of one rank passes the tensor to itself."""

    def __init__(self, ring: "Ring", send: torch.Tensor, tag: int):
        self.recv, self.works = send, []
        if ring.size == 1:
            return
        self.recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, ring.next_rank, ring.group, tag),
               dist.P2POp(dist.irecv, self.recv, ring.prev_rank, ring.group, tag)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.recv


@dataclass
class Ring:
    """The cp ranks as a ring, this rank's place in it, and the global positions of every
    rank's block (the causal mask and ALiBi read them)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    next_rank: int
    prev_rank: int
    positions: list[torch.Tensor]

    @classmethod
    def build(cls, group: Group, seq_len: int, device) -> "Ring":
        pg, rank, size = process_group(group), group_rank(group), group_size(group)
        return cls(pg, rank, size, dist.get_global_rank(pg, (rank + 1) % size),
                   dist.get_global_rank(pg, (rank - 1) % size),
                   [context_parallel_positions(seq_len, size, j, device) for j in range(size)])

    def step_block(self, t: int) -> int:
        """The rank whose key/value block this rank holds at step t."""
        return (self.rank - t) % self.size


class _RingAttention(torch.autograd.Function):
    """forward: ring of key/value blocks, outputs merged by log-sum-exp;
    backward: ring of key/value blocks with their gradient accumulators.
    q [b, hq, n, d], k, v [b, hk, n, d] contiguous -> out [b, hq, n, d]."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, kernel: BlockKernel):
        n, c = q.shape[2], q.shape[2] // 2
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        kv = torch.stack([k, v])  # [2, b, hk, n, d]: one message per step
        for t in range(ring.size):
            pending = _Exchange(ring, kv, KV_TAG) if t + 1 < ring.size else None
            rows, qb, kb, vb, causal, k_pos = _block(t, ring, q, kv, c)
            o, l = kernel.forward(qb, kb, vb, causal, ring.positions[ring.rank][rows], k_pos)
            _merge(out[:, :, rows], lse[:, :, rows], o, l)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.n = ring, kernel, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel, c = ctx.ring, ctx.kernel, ctx.n // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv, grads_in = torch.stack([k, v]), None
        for t in range(ring.size):
            pending = _Exchange(ring, kv, KV_TAG) if t + 1 < ring.size else None
            rows, qb, kb, vb, causal, k_pos = _block(t, ring, q, kv, c)
            dq_b, dk_b, dv_b = kernel.backward(dout[:, :, rows], qb, kb, vb, out[:, :, rows],
                                               lse[:, :, rows], causal,
                                               ring.positions[ring.rank][rows], k_pos)
            dq[:, :, rows] += dq_b
            grads = kv.new_zeros(kv.shape, dtype=torch.float32)  # [2, b, hk, n, d]
            grads[:, :, :, :kb.shape[2]] = torch.stack([dk_b, dv_b])  # j < r: the first chunk
            if grads_in is not None:
                grads += grads_in.wait()  # the accumulator of this block, from rank r - 1
            grads_in = _Exchange(ring, grads, GRAD_TAG)
            if pending is not None:
                kv = pending.wait()
        dkv = grads_in.wait()  # this rank's own block, every rank's share in it
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _block(t: int, ring: Ring, q: torch.Tensor, kv: torch.Tensor, c: int):
    """What step t computes (the module docstring's table): the query rows, q / k / v of the
    block, whether it is masked, and the keys' global positions."""
    j = ring.step_block(t)
    k_pos = ring.positions[j]
    if t == 0:
        return slice(None), q, kv[0], kv[1], True, k_pos
    if j < ring.rank:
        return slice(None), q, kv[0, :, :, :c], kv[1, :, :, :c], False, k_pos[:c]
    return slice(c, None), q[:, :, c:], kv[0], kv[1], False, k_pos


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """In place, float32: fold one block's (output, lse) into the running (out, lse) rows."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                   seq_len: int, kernel: BlockKernel) -> torch.Tensor:
    """Causal attention of this rank's two chunks over the whole sequence of `seq_len` tokens
    split over the ring `group`: q [n, b, hq, d], k, v [n, b, hk, d] -> out [n, b, hq, d]
    (the module docstring). One rank: causal attention of the whole sequence."""
    n = q.shape[0]
    if n * group_size(group) != seq_len or n % 2:
        raise ValueError(f"ring attention: {n} local tokens x cp={group_size(group)} ranks do "
                         f"not make the sequence of {seq_len} in two equal chunks per rank")
    qb, kb, vb = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))  # [b, h, n, d]
    if group_size(group) == 1:
        ring = Ring(None, 0, 1, 0, 0, [torch.arange(n, device=q.device)])
    else:
        ring = Ring.build(group, seq_len, q.device)
    out = _RingAttention.apply(qb, kb, vb, ring, kernel)
    return out.permute(2, 0, 1, 3)  # [n, b, hq, d]
