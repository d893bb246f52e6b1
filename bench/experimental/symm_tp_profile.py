"""`bench.profile_train` with megazoo's tp collectives moved onto symmetric memory: where the
time goes when torch's copy-engine paths run inside training.

    torchrun --nproc-per-node 2 -m bench.experimental.symm_tp_profile --symm fused \\
        --gaps 20 -- <pretrain_gpt.py flags, tp + --sequence-parallel --tp-comm-overlap
        --enable-cuda-graph>
    torchrun --nproc-per-node 2 -m bench.experimental.symm_tp_profile --symm low-contention \\
        -- <the same flags without --tp-comm-overlap>

Two ways, each patching `megazoo.layers.tp_overlap` before `bench.profile_train` runs with
the arguments after `--` (every option before it but `--symm` is profile_train's):
- `fused`: the chunked paths that --tp-comm-overlap takes (`gather_matmul`,
  `matmul_reduce_scatter`; forward all-gather + GEMM and GEMM + reduce-scatter, backward
  output-gradient all-gather + dgrad and dgrad + reduce-scatter) become
  `torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, which pull
  peers' shards with the copy engines while the GEMM runs, chunk by chunk
  (bench/results/tp_exposed_comm_h200x4_2026-11-28.md: +4% at tp 2);
- `low-contention`: the one-call paths (`gather_rows`, `matmul_reduce_scatter` at one
  chunk, and the sequence all-gather / reduce-scatter of `megazoo.layers.mappings` that the
  fused GELU MLP and the embedding use) become
  `torch.ops.symm_mem._low_contention_all_gather` / `_reduce_scatter`: the same transfers
  as NCCL's, on the copy engines instead of SMs, the reduce-scatter summing on a side
  stream. NCCL's calls take about twice their wire time at these sizes.
An experiment, not a product path: the layers never call it. NVLink multicast stays off.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")

import torch  # noqa: E402
import torch.distributed._symmetric_memory  # noqa: E402, F401 (registers torch.ops.symm_mem)

from megazoo.layers import mappings, tp_overlap  # noqa: E402
from megazoo.layers.groups import process_group  # noqa: E402

_PLAIN = {"gather_rows": tp_overlap.gather_rows,
          "matmul_reduce_scatter": tp_overlap.matmul_reduce_scatter,
          "_gather": mappings._gather, "_reduce_scatter": mappings._reduce_scatter}


def _name(group) -> str:
    return process_group(group).group_name


def fused_gather_matmul(x_shard, b, group, k):
    """(x_full, x_full @ b) through `fused_all_gather_matmul` over rows."""
    rows = x_shard.reshape(-1, x_shard.shape[-1]).contiguous()
    x_full, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
        rows, [b], 0, _name(group), return_A=True)
    tp = x_full.shape[0] // rows.shape[0]
    lead = (tp * x_shard.shape[0],) + tuple(x_shard.shape[1:-1])
    return x_full.view(lead + (x_shard.shape[-1],)), y.view(lead + (b.shape[1],))


def fused_matmul_reduce_scatter(a, b, group, k):
    """(a @ b reduce-scattered over rows, nothing in flight) through
    `fused_matmul_reduce_scatter`."""
    rows = a.reshape(-1, a.shape[-1]).contiguous()
    y = torch.ops.symm_mem.fused_matmul_reduce_scatter(rows, b, "sum", 0, _name(group))
    tp = rows.shape[0] // y.shape[0]
    return y.view((a.shape[0] // tp,) + tuple(a.shape[1:-1]) + (b.shape[1],)), tp_overlap.InFlight()


class _Landing:
    """A low-contention result's readiness: `wait()` orders the current stream after it."""

    def __init__(self, tensor):
        self.tensor = tensor

    def wait(self):
        torch.ops._c10d_functional.wait_tensor(self.tensor)


def low_contention_gather_rows(x_shard, group, k):
    if k > 1 or not x_shard.is_cuda:
        return _PLAIN["gather_rows"](x_shard, group, k)
    out = torch.ops.symm_mem._low_contention_all_gather(x_shard.contiguous(), _name(group))
    return torch.ops._c10d_functional.wait_tensor(out)


def low_contention_matmul_reduce_scatter(a, b, group, k):
    if k > 1 or not a.is_cuda:
        return _PLAIN["matmul_reduce_scatter"](a, b, group, k)
    part = torch.matmul(a.contiguous(), b)
    y_shard = torch.ops.symm_mem._low_contention_reduce_scatter(part, "sum", _name(group))
    in_flight = tp_overlap.InFlight()
    in_flight.add(_Landing(y_shard), part)
    return y_shard, in_flight


def low_contention_gather(x, dim, group):
    if not x.is_cuda or dim not in (0, -x.dim()):
        return _PLAIN["_gather"](x, dim, group)
    return low_contention_gather_rows(x, group, 1)


def low_contention_reduce_scatter(x, group):
    if not x.is_cuda:
        return _PLAIN["_reduce_scatter"](x, group)
    y = torch.ops.symm_mem._low_contention_reduce_scatter(x.contiguous(), "sum", _name(group))
    return torch.ops._c10d_functional.wait_tensor(y)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    p.add_argument("--symm", choices=["fused", "low-contention"], required=True)
    mine, rest = p.parse_known_args(argv[:argv.index("--")] if "--" in argv else argv)
    rest += argv[argv.index("--"):] if "--" in argv else []
    if mine.symm == "fused":
        tp_overlap.gather_matmul = fused_gather_matmul
        tp_overlap.matmul_reduce_scatter = fused_matmul_reduce_scatter
    else:
        tp_overlap.gather_rows = low_contention_gather_rows
        tp_overlap.matmul_reduce_scatter = low_contention_matmul_reduce_scatter
        mappings._gather = low_contention_gather
        mappings._reduce_scatter = low_contention_reduce_scatter
    from bench.profile_train import main as profile

    return profile(rest)


if __name__ == "__main__":
    sys.exit(main())
