"""`FusedColumnParallelLinear`: several column-parallel projections of one input in one matmul.

The full weight is the blocks `[W_0; W_1; ...]` stacked along the output dimension (rows).
Each block is split over tp on its own and rank r holds `[W_0,r; W_1,r; ...]`, so the outputs
of one rank's blocks sit side by side and need no communication to be taken apart
(SwiGLU's gate and up projections; a fused QKV). The parameters carry `tp_parts` so
`tp_slice` / `tp_unslice` know the layout.
"""
from __future__ import annotations

import itertools

from .groups import Group, divide, group_rank, group_size
from .init import default_init, init_shard_
from .linear import ColumnParallelLinear
from .sharding import set_tp_layout


class FusedColumnParallelLinear(ColumnParallelLinear):
    """x [s, b, in] -> y_shard [s, b, sum(parts)/tp], laid out `[y_0,r, y_1,r, ...]`.

    `parts` are the full output sizes of the fused blocks; each must divide by tp. With
    sequence_parallel, x is the sequence shard [s/tp, b, in] (gathered first).
    """

    def __init__(self, in_features: int, parts: tuple[int, ...], *, group: Group,
                 bias: bool = True, sequence_parallel: bool = False, init_method=None,
                 device=None, dtype=None, fp8=None):
        tp = group_size(group)
        parts = tuple(parts)
        local = [divide(p, tp, f"fused block of {p} outputs over tp={tp}") for p in parts]
        init_method = init_method or default_init()
        # The parent allocates [sum/tp, in]; its contiguous init is replaced below.
        super().__init__(in_features, sum(parts), group=group, bias=bias,
                         sequence_parallel=sequence_parallel, init_method=lambda w: None,
                         device=device, dtype=dtype, fp8=fp8)
        self.parts = parts
        set_tp_layout(self.weight, 0, parts=parts)
        if self.bias is not None:
            set_tp_layout(self.bias, 0, parts=parts)
        first_rows = itertools.accumulate(parts[:-1], initial=0)  # each block's, in the full W
        for block, first, n in zip(self.weight.split(local), first_rows, local):
            init_shard_(block, init_method, first + group_rank(group) * n, 0)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, " + super().extra_repr()
