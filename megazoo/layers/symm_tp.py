"""The CUDA path of --tp-comm-overlap: GEMMs fused with their transfers through symmetric memory.

`tp_overlap`'s chunked NCCL path keeps the all-gather of chunk i + 1 in flight while chunk i
multiplies, but NCCL's kernels run on the SMs the GEMM holds, and on H200 NVLink each call
takes about twice its wire time: chunking there lost to one call per GEMM. torch's async-TP
ops (`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`) instead
copy peers' shards with the copy engines, over NVLink peer-to-peer, while the GEMM runs on
the rows already present, one chunk per rank. They need NVLink multicast nowhere
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is honoured). The measured effect is in bench/README.md.

Rows: both ops work on the 2-D view [S b, K] of a sequence-major activation [S, b, K], so
gathering or scattering along its rows is gathering or scattering along the sequence, in the
layout `tp_overlap` uses.
"""
from __future__ import annotations

import torch

from ..parallel.state import runs_nccl
from .groups import Group, process_group


def usable(x: torch.Tensor, group: Group) -> bool:
    """Whether the fused ops can run for `x` over `group`: a CUDA tensor, a group whose CUDA
    backend is NCCL, and a torch that has the ops."""
    if not x.is_cuda or not runs_nccl(process_group(group)):
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 (registers torch.ops.symm_mem)
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")


def gather_matmul(x_shard: torch.Tensor, b: torch.Tensor, group: Group):
    """`tp_overlap.gather_matmul` on the copy engines: (x_full [tp S, *mid, K],
    x_full @ b [tp S, *mid, N]) for x_shard [S, *mid, K], b [K, N]."""
    rows = x_shard.reshape(-1, x_shard.shape[-1]).contiguous()
    x_full, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
        rows, [b], 0, process_group(group).group_name, return_A=True)
    lead = (x_full.shape[0] // rows.shape[0] * x_shard.shape[0],) + tuple(x_shard.shape[1:-1])
    return x_full.view(lead + (x_shard.shape[-1],)), y.view(lead + (b.shape[1],))


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Group) -> torch.Tensor:
    """`tp_overlap.matmul_reduce_scatter` on the copy engines: (a @ b) summed over the group
    and scattered along rows, [s/tp, *mid, N] for a [s, *mid, K], b [K, N]; ready on return
    (stream-ordered)."""
    rows = a.reshape(-1, a.shape[-1]).contiguous()
    y = torch.ops.symm_mem.fused_matmul_reduce_scatter(
        rows, b, "sum", 0, process_group(group).group_name)
    tp = rows.shape[0] // y.shape[0]
    return y.view((a.shape[0] // tp,) + tuple(a.shape[1:-1]) + (b.shape[1],))
