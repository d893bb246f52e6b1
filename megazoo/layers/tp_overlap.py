"""Megatron-SP communication overlapped with the GEMMs around it, chunk by chunk.

Under Megatron sequence parallelism a column-parallel linear all-gathers its input along the
sequence before its GEMM and a row-parallel linear reduce-scatters its output after its
GEMM. Unsplit, each collective waits for (or is waited on by) the whole GEMM. Here the local
sequence shard is cut into k chunks and `chunk_pipeline` runs

    start fetch(0)
    for i: start fetch(i+1); wait fetch(i); compute(i); start send(i)
    (the caller waits for the sends, after its own work)

so the all-gather of chunk i+1 travels while chunk i multiplies, and the reduce-scatter of
chunk i while chunk i+1 multiplies (the idea of Megatron-core's `--tp-comm-overlap` and
torchtitan's async TP). The collectives are plain asynchronous gloo or NCCL calls on their
own stream, no NVLink multicast. On CUDA with NCCL the chunked GEMMs go to `symm_tp`
instead, torch's fused ops that move the shards with the copy engines. `work.wait()` orders the
compute stream after a transfer without a host sync. With k = 1 (the plain path of
`ColumnParallelLinear` / `RowParallelLinear` under sequence parallelism, which always runs
through here) each GEMM is one collective and one GEMM, issued directly, the bias in the
GEMM: no chunk bookkeeping. The host issues every block of every micro-batch, and under tp
at micro-batch 4 it, not the GPU, sets the pace (bench/results/tp_host_bound_h200_2026-11-28.md).

Rows. Chunk i of every rank's shard [S = s/tp rows] gathers into rows j S + i m .. + m of
the full sequence for each rank j (m = S/k): tp contiguous blocks, multiplied block by block
into the matching rows of the output, so nothing is copied to reorder and the activation
layout stays [s, b, h].

Backward (the linears' Functions):
- column: dgrad dy W in chunks, each chunk's reduce-scatter started as soon as it is
  computed; the weight-gradient GEMM dy^T x_full runs while the last reduce-scatters travel.
  The gathered input is kept from forward, so backward re-gathers nothing (Megatron
  re-gathers it to save (1 - 1/tp) s b h of activation memory per column GEMM).
- row: the output gradient all-gathered in chunks overlapping the dgrad GEMM of the
  previous chunk, then the weight gradient.

Per layer and micro-batch at tp > 1 with sequence parallelism this is 2 all-gathers and 2
reduce-scatters forward and the same backward (k of each per GEMM when chunked), no
all-reduce: `tests/layers/test_comm_counts.py`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.collectives import all_gather_flat, reduce_scatter_flat
from . import symm_tp
from .groups import Group, group_size, process_group
from .wgrad import weight_grad

TP_COMM_CHUNKS = 4
"""Chunks per GEMM under --tp-comm-overlap where the chunked path runs (not CUDA over NCCL,
which takes `symm_tp`): a quarter of the transfer stays exposed (the first all-gather chunk,
the last reduce-scatter chunk), and each chunk's GEMM keeps s b / (tp 4) rows (2048 at the
gpt-1.3b shape, micro-batch 4, tp 2), large enough to run at the GEMM's full rate."""


class InFlight:
    """Transfers started and not yet waited for; holds each one's buffers until `wait()`
    (the one owner of those buffers: nothing else may free or reuse them before)."""

    def __init__(self):
        self._items: list = []

    def add(self, work, *buffers) -> None:
        self._items.append((work, buffers))

    def wait(self) -> None:
        for work, _ in self._items:
            work.wait()
        self._items = []


def chunk_pipeline(num_chunks: int, compute, fetch=None, send=None) -> InFlight:
    """compute(i) for i < num_chunks, the transfers of other chunks in flight meanwhile.

    fetch(i) -> Work: starts bringing chunk i's input; chunk i+1's is started before chunk
    i's is waited for. compute(i) -> result. send(i, result) -> Work: starts sending chunk
    i's result; returned (with the result, kept alive) for the caller to wait on after its
    own overlapped work.
    """
    outgoing = InFlight()
    incoming = fetch(0) if fetch else None
    for i in range(num_chunks):
        following = fetch(i + 1) if fetch and i + 1 < num_chunks else None
        if incoming is not None:
            incoming.wait()
        result = compute(i)
        if send is not None:
            outgoing.add(send(i, result), result)
        incoming = following
    return outgoing


def chunk_rows(shard_rows: int, tp: int, k: int, i: int) -> list[tuple[int, int]]:
    """[lo, hi) rows of the full sequence in chunk i: block i of every rank's shard, adjacent
    blocks merged (k = 1: the whole sequence, one block)."""
    m = shard_rows // k
    rows: list[tuple[int, int]] = []
    for j in range(tp):
        lo = j * shard_rows + i * m
        if rows and rows[-1][1] == lo:
            rows[-1] = (rows[-1][0], lo + m)
        else:
            rows.append((lo, lo + m))
    return rows


def usable_chunks(shard_rows: int, requested: int) -> int:
    """The largest chunk count <= `requested` that divides the sequence shard's rows (chunks
    are whole rows; 1 always does)."""
    return max(k for k in range(1, max(requested, 1) + 1) if shard_rows % k == 0)


def gather_rows(x_shard: torch.Tensor, group: Group, k: int) -> torch.Tensor:
    """x_shard [S, ...] -> x_full [tp S, ...], empty for k > 1 (`gather_matmul` fills it chunk
    by chunk), all-gathered in one call for k = 1 (stream-ordered, no host wait)."""
    x_shard = x_shard.contiguous()
    x_full = x_shard.new_empty((group_size(group) * x_shard.shape[0],) + tuple(x_shard.shape[1:]))
    if k == 1:
        all_gather_flat(x_full, x_shard, group=process_group(group))
    return x_full


def gather_matmul(x_shard: torch.Tensor, b: torch.Tensor, group: Group, k: int):
    """x_shard [S, *mid, K] all-gathered along rows (k chunks) and multiplied as it arrives:
    (x_full [tp S, *mid, K], x_full @ b [tp S, *mid, N]) for b [K, N]."""
    if k > 1 and symm_tp.usable(x_shard, group):
        return symm_tp.gather_matmul(x_shard, b, group)
    x_full = gather_rows(x_shard, group, k)
    if k == 1:
        return x_full, torch.matmul(x_full, b)
    tp, pg, S = group_size(group), process_group(group), x_shard.shape[0]
    m = S // k
    y = x_shard.new_empty((tp * S,) + tuple(x_shard.shape[1:-1]) + (b.shape[1],))

    def fetch(i):
        blocks = [x_full[j * S + i * m:j * S + (i + 1) * m] for j in range(tp)]
        return dist.all_gather(blocks, x_shard[i * m:(i + 1) * m], group=pg, async_op=True)

    def compute(i):
        for lo, hi in chunk_rows(S, tp, k, i):
            torch.matmul(x_full[lo:hi], b, out=y[lo:hi])

    chunk_pipeline(k, compute, fetch=fetch)
    return x_full, y


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Group, k: int):
    """(a @ b) reduce-scattered along rows, chunk by chunk as it is computed: a [s, *mid, K],
    b [K, N] -> (y_shard [s/tp, *mid, N], the reduce-scatters in flight: wait before use)."""
    if k > 1 and symm_tp.usable(a, group):
        return symm_tp.matmul_reduce_scatter(a, b, group), InFlight()
    tp, pg = group_size(group), process_group(group)
    a = a.contiguous()
    S = a.shape[0] // tp
    m = S // k
    y_shard = a.new_empty((S,) + tuple(a.shape[1:-1]) + (b.shape[1],))
    if k == 1:
        outgoing, part = InFlight(), torch.matmul(a, b)
        outgoing.add(reduce_scatter_flat(y_shard, part, group=pg, async_op=True), part)
        return y_shard, outgoing

    def compute(i):
        part = a.new_empty((tp * m,) + tuple(y_shard.shape[1:]))  # [tp m, *mid, N]
        for j, (lo, hi) in enumerate(chunk_rows(S, tp, k, i)):
            torch.matmul(a[lo:hi], b, out=part[j * m:(j + 1) * m])
        return part

    def send(i, part):
        return reduce_scatter_flat(y_shard[i * m:(i + 1) * m], part, group=pg, async_op=True)

    return y_shard, chunk_pipeline(k, compute, send=send)


def _weight_grad(weight, dy: torch.Tensor, x: torch.Tensor, want_db: bool):
    """`wgrad.weight_grad` for dy [.., N], x [.., K] of any leading shape."""
    return weight_grad(weight, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), want_db)


class _GatherLinear(torch.autograd.Function):
    """Column-parallel linear under Megatron SP. forward: all-gather + GEMM in chunks;
    backward: dgrad + reduce-scatter in chunks, the weight gradient beside the last ones.

    | tensor | shape |
    |---|---|
    | x_shard (input) | [s/tp, b, in] |
    | x_full (saved) | [s, b, in] |
    | weight | [out/tp, in] |
    | y_shard (output) | [s, b, out/tp] |
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, k):
        if k == 1:
            x_full = gather_rows(x_shard, group, 1)
            y = F.linear(x_full, weight, bias)
        else:
            x_full, y = gather_matmul(x_shard, weight.t(), group, k)
            if bias is not None:
                y.add_(bias)
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.k, ctx.has_bias = group, k, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_full, weight = ctx.saved_tensors
        dx_shard, in_flight = matmul_reduce_scatter(dy, weight, ctx.group, ctx.k)
        dw, db = _weight_grad(weight, dy, x_full, ctx.has_bias)  # beside the reduce-scatters
        in_flight.wait()
        return dx_shard, dw, db, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel linear under Megatron SP, without its bias. forward: GEMM +
    reduce-scatter in chunks; backward: all-gather of the output gradient + dgrad in
    chunks, then the weight gradient.

    | tensor | shape |
    |---|---|
    | x (input, saved) | [s, b, in/tp] |
    | weight | [out, in/tp] |
    | y_shard (output) | [s/tp, b, out] |
    """

    @staticmethod
    def forward(ctx, x, weight, group, k):
        y_shard, in_flight = matmul_reduce_scatter(x, weight.t(), group, k)
        in_flight.wait()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.k = group, k
        return y_shard

    @staticmethod
    def backward(ctx, dy_shard):
        x, weight = ctx.saved_tensors
        dy_full, dx = gather_matmul(dy_shard, weight, ctx.group, ctx.k)
        return dx, _weight_grad(weight, dy_full, x, False)[0], None, None


def gather_linear(x_shard, weight, bias, group: Group, k: int) -> torch.Tensor:
    """x_shard [s/tp, b, in] -> x_full W^T + b [s, b, out/tp] (`_GatherLinear`) in up to k
    chunks (`usable_chunks`)."""
    return _GatherLinear.apply(x_shard, weight, bias, group, usable_chunks(x_shard.shape[0], k))


def linear_reduce_scatter(x, weight, group: Group, k: int) -> torch.Tensor:
    """x [s, b, in/tp] -> reduce-scatter over tp of x W^T [s/tp, b, out] (no bias)."""
    tp = group_size(group)
    if x.shape[0] % tp:
        raise ValueError(f"sequence dimension {x.shape[0]} is not divisible by the group size "
                         f"{tp}: choose a sequence length that divides")
    return _LinearReduceScatter.apply(x, weight, group, usable_chunks(x.shape[0] // tp, k))
