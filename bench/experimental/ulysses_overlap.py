"""Ulysses attention with the all-to-alls overlapped with attention, head chunk by head chunk.

Experimental, outside the library: no model uses it. Finding: on 2x H200 it runs within 1.5%
of `megazoo.layers.UlyssesAttention` at every length measured, because cuDNN's fused
attention (SDPA's default on Hopper) leaves no SMs to the NCCL kernels issued beside it, so
the transfers do not overlap (bench/README.md, ulysses_bench.py and stream_priority_probe.py).
It stays here, tested against the one-process block, for hardware or kernels where that
differs; wiring it into ParallelAttention is worth it only after a measured win.

The same function as `UlyssesAttention` (ulysses.py: shapes, head layout, ALiBi slopes of the
global heads, RoPE with global positions, GQA kv copies, padding masks), computed as a
pipeline over k chunks of this rank's kv groups. Forward, with in(c) / out(c) the first and
second all-to-all of chunk c and att(c) its local attention:

    issue in(0)
    for c: issue in(c+1); wait in(c); att(c); issue out(c)       # att(c) overlaps in(c+1), out(c-1)
    wait out(0..k-1)

Backward runs the reverse pipeline with the gradients (grad in(c) = heads-to-sequence of the
output gradient's chunk c, then attention backward, then grad out(c) = sequence-to-heads)
through the autograd graphs of att(c) built in the forward: nothing is recomputed. On NCCL an
asynchronous all-to-all runs on the communication stream and `wait()` orders the compute
stream after it, so attention of one chunk runs while the next chunk travels; only in(0) and
out(k-1) (1/k of the traffic each way) stay exposed. On gloo the same code runs the
collectives on a background thread (tests).

| tensor | shape (sp = n, k chunks, f = KS (GS+2) d features per destination) |
|---|---|
| x_send (input of the Function) | [s/n, b, n f]: `UlyssesAttention.send_buffer`, destination-major |
| send of chunk c | [n, s/n, b, f/k]: for each destination j, its kv groups [c KS/k, (c+1) KS/k) |
| qkv_c (received) | [n, s/n, b, f/k] = [s, b, f/k]: the full sequence of chunk c's groups |
| context_c | [s, b, hc d], hc = KS GS / k query heads |
| out (output) | [s/n, b, n k hc d] = [s/n, b, (H/tp) d]: global head order (j, then c) |

Chunks are whole kv groups, so k must divide KS (the kv groups per rank after the split);
`num_chunks=None` picks the largest divisor of KS up to 4. With one kv group per rank (GQA
with few kv heads) k = 1: the same results, without overlap.

Where it overlaps: only where the attention kernel leaves SMs to the NCCL kernels. SDPA's
default on Hopper (cuDNN's fused attention) does not: nothing issued beside it runs before its
last wave, at any stream priority (bench/stream_priority_probe.py, H200), so there the transfers
run between the chunks' attention calls and k > 1 only makes those calls smaller; measured on
2x H200 it is within 1.5% of UlyssesAttention either way (bench/README.md).

Memory: the same as UlyssesAttention (each chunk's attention keeps what the kernel keeps;
together they keep what one call over all heads keeps). Untested under activation
checkpointing (ParallelAttention's `recompute_core` runs the attention in non-reentrant
checkpoint, whose saved-tensor hooks would see the per-chunk graphs this Function keeps on
its context). Use it where the attention is built directly (bench/ulysses_bench.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazoo.layers.groups import Group, group_size, process_group
from megazoo.layers.ulysses import UlyssesAttention

DEFAULT_MAX_CHUNKS = 4


class PendingAllToAll:
    """An all_to_all_single in flight (`start_all_to_all`); `wait()` returns the received tensor.

    On NCCL the collective runs on the communication stream and `wait()` makes the current
    stream wait for it, so compute issued in between overlaps the transfer; on gloo it runs on
    a background thread. Keep the send buffer alive until `wait()` (this object holds it).
    """

    def __init__(self, work, send: torch.Tensor, recv: torch.Tensor):
        self.work, self.send, self.recv = work, send, recv

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.send = None
        return self.recv


def start_all_to_all(send: torch.Tensor, group: Group) -> PendingAllToAll:
    """Asynchronous all-to-all of `send` [n, ...] (block j to rank j) -> recv [n, ...] (block j
    from rank j), same shape. No autograd: the pipeline schedules its own backward."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=process_group(group), async_op=True)
    return PendingAllToAll(work, send, recv)


def choose_num_chunks(kv_groups: int, requested: int | None) -> int:
    """k: `requested` if it divides the kv groups a rank attends, else a ValueError; None picks
    the largest divisor of kv_groups that is at most DEFAULT_MAX_CHUNKS."""
    if requested is None:
        return max(k for k in range(1, DEFAULT_MAX_CHUNKS + 1) if kv_groups % k == 0)
    if requested < 1 or kv_groups % requested != 0:
        raise ValueError(f"num_chunks={requested} must divide the {kv_groups} kv groups each "
                         f"rank attends after the Ulysses split (chunks are whole kv groups); "
                         f"choose a divisor of {kv_groups} or None")
    return requested


def _pack(x: torch.Tensor, n: int, k: int, c: int) -> torch.Tensor:
    """Chunk c of x [s/n, b, n k f] as a send buffer [n, s/n, b, f] (one copy)."""
    s_local, b = x.shape[0], x.shape[1]
    return x.view(s_local, b, n, k, -1)[:, :, :, c].permute(2, 0, 1, 3).contiguous()


def _unpack_into(out: torch.Tensor, recv: torch.Tensor, k: int, c: int) -> None:
    """Write recv [n, s/n, b, f] (block j from rank j) into chunk c of out [s/n, b, n k f]."""
    n, s_local, b, _ = recv.shape
    out.view(s_local, b, n, k, -1)[:, :, :, c].copy_(recv.permute(1, 2, 0, 3))


def _pipeline(x: torch.Tensor, n: int, k: int, group, stage, out_features: int) -> torch.Tensor:
    """in(c) -> stage(c, full_c) -> out(c) for every chunk, the transfer of one chunk overlapping
    the stage of another. x [s/n, b, n k f_in] -> [s/n, b, n k f_out], f_out = out_features.

    stage(c, t [s, b, f_in]) -> [s, b, f_out]. Used by the forward (stage = attention) and the
    backward (stage = attention backward), whose data moves the same way.
    """
    s_local, b = x.shape[0], x.shape[1]
    out = x.new_empty(s_local, b, n * k * out_features)
    incoming = start_all_to_all(_pack(x, n, k, 0), group)
    outgoing = []
    for c in range(k):
        following = start_all_to_all(_pack(x, n, k, c + 1), group) if c + 1 < k else None
        full_c = incoming.wait().view(n * s_local, b, -1)  # [s, b, f_in]
        result = stage(c, full_c).contiguous()  # [s, b, f_out] = [n, s/n, b, f_out]
        outgoing.append(start_all_to_all(result.view(n, s_local, b, -1), group))
        incoming = following
    for c, pending in enumerate(outgoing):
        _unpack_into(out, pending.wait(), k, c)
    return out


class _OverlappedUlysses(torch.autograd.Function):
    """forward: the chunked all-to-all -> attention -> all-to-all pipeline; backward: the same
    pipeline over the gradients, through the per-chunk attention graphs saved in forward
    (kept only when `track`: under no_grad nothing is saved).

    x_send [s/n, b, n k f] -> out [s/n, b, n k hc d] (module docstring).
    """

    @staticmethod
    def forward(ctx, x_send, attend, group, k, heads_out, track):
        n = group_size(group)
        ctx.group, ctx.k, ctx.graphs = group, k, [None] * k

        def stage(c, qkv_c):
            if not track:
                return attend(c, qkv_c)
            with torch.enable_grad():
                leaf = qkv_c.detach().requires_grad_()
                context_c = attend(c, leaf)
            ctx.graphs[c] = (leaf, context_c)
            return context_c.detach()

        return _pipeline(x_send, n, k, group, stage, heads_out)

    @staticmethod
    def backward(ctx, grad_out):
        graphs, ctx.graphs = ctx.graphs, None
        n = group_size(ctx.group)

        def stage(c, grad_context_c):
            leaf, context_c = graphs[c]
            graphs[c] = None  # free chunk c's saved activations as soon as it is done
            (grad_qkv_c,) = torch.autograd.grad(context_c, leaf, grad_context_c.view_as(context_c))
            return grad_qkv_c

        features_in = graphs[0][0].shape[-1]
        grad_x = _pipeline(grad_out.contiguous(), n, ctx.k, ctx.group, stage, features_in)
        return grad_x, None, None, None, None, None


class UlyssesOverlapAttention(UlyssesAttention):
    """UlyssesAttention computed as a pipeline over `num_chunks` chunks of kv groups, each
    chunk's all-to-alls overlapping another chunk's attention (module docstring).

    Same arguments as UlyssesAttention, plus num_chunks (None: automatic). With an sp group of
    one rank it is plain local attention.
    """

    def __init__(self, num_heads: int, head_dim: int, *, num_chunks: int | None = None,
                 sp_group: Group = None, **kwargs):
        super().__init__(num_heads, head_dim, sp_group=sp_group, **kwargs)
        self.num_chunks = choose_num_chunks(self.layout.sp_groups[0], num_chunks)

    def forward(self, qkv: torch.Tensor, padding_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [s/sp, b, KL (GL+2) d] -> context [s/sp, b, (H/tp) d], as UlyssesAttention."""
        if self.layout.sp == 1:
            return super().forward(qkv, padding_mask, position_ids)
        x_send, s = self.send_buffer(qkv, padding_mask, position_ids)
        k, (ks, gs), d = self.num_chunks, self.layout.sp_groups, self.layout.head_dim
        heads = ks * gs // k  # query heads per chunk
        rope = self.rope_factors(position_ids, s, qkv)
        slopes = self.slopes(qkv.device)

        def attend(c, qkv_c):  # [s, b, ks/k (gs+2) d] -> [s, b, heads d]
            chunk_slopes = None if slopes is None else slopes[c * heads:(c + 1) * heads]
            return self.attend(qkv_c, padding_mask, rope, chunk_slopes)

        track = torch.is_grad_enabled() and x_send.requires_grad  # keep per-chunk graphs
        return _OverlappedUlysses.apply(x_send, attend, self.sp_group, k, heads * d, track)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_chunks={self.num_chunks}"
