"""`bench.profile_train` with torch's symmetric-memory async-TP ops in place of megazoo's
chunked NCCL path: where the time goes when they run inside training.

    torchrun --nproc-per-node 2 -m bench.experimental.symm_tp_profile --gaps 20 -- \\
        <pretrain_gpt.py flags with --tensor-model-parallel-size 2 --sequence-parallel
         --tp-comm-overlap --enable-cuda-graph>

Alone, captured in a CUDA graph, `torch.ops.symm_mem.fused_all_gather_matmul` and
`fused_matmul_reduce_scatter` beat one NCCL call + GEMM at every tp 2 GEMM of gpt-1.3b
(bench/results/async_tp_h200_2026-11-28.md); in training they lost 13%. This patches
`megazoo.layers.tp_overlap.gather_matmul` and `matmul_reduce_scatter` (the paths
--tp-comm-overlap takes: forward all-gather + GEMM and GEMM + reduce-scatter, backward
output-gradient all-gather + dgrad and dgrad + reduce-scatter) with the fused ops, then runs
`bench.profile_train` with the arguments given. An experiment, not a product path: the
layers never call it. NVLink multicast stays off.
"""
from __future__ import annotations

import os
import sys

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")

import torch  # noqa: E402
from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: E402 (registers the ops)

from megazoo.layers import tp_overlap  # noqa: E402
from megazoo.layers.groups import process_group  # noqa: E402

_ENABLED: set[str] = set()


def _name(group) -> str:
    name = process_group(group).group_name
    if name not in _ENABLED:
        enable_symm_mem_for_group(name)
        _ENABLED.add(name)
    return name


def gather_matmul(x_shard, b, group, k):
    """(x_full, x_full @ b) through `fused_all_gather_matmul` over rows."""
    rows = x_shard.reshape(-1, x_shard.shape[-1]).contiguous()
    x_full, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
        rows, [b], 0, _name(group), return_A=True)
    tp = x_full.shape[0] // rows.shape[0]
    lead = (tp * x_shard.shape[0],) + tuple(x_shard.shape[1:-1])
    return x_full.view(lead + (x_shard.shape[-1],)), y.view(lead + (b.shape[1],))


def matmul_reduce_scatter(a, b, group, k):
    """(a @ b reduce-scattered over rows, nothing in flight) through
    `fused_matmul_reduce_scatter`."""
    rows = a.reshape(-1, a.shape[-1]).contiguous()
    y = torch.ops.symm_mem.fused_matmul_reduce_scatter(rows, b, "sum", 0, _name(group))
    tp = rows.shape[0] // y.shape[0]
    return y.view((a.shape[0] // tp,) + tuple(a.shape[1:-1]) + (b.shape[1],)), tp_overlap.InFlight()


def main(argv=None) -> int:
    tp_overlap.gather_matmul = gather_matmul
    tp_overlap.matmul_reduce_scatter = matmul_reduce_scatter
    from bench.profile_train import main as profile

    return profile(argv)


if __name__ == "__main__":
    sys.exit(main())
