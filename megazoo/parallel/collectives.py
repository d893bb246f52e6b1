"""The flat all-gather and reduce-scatter under their current torch names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single`
/ `reduce_scatter_single` (the old names warn); torch 2.11 (the GPU image) has only the old
names. Each name here is the current one where it exists.

    all_gather_flat(out, x, group=pg, async_op=False)       # out = cat of every rank's x
    reduce_scatter_flat(out, x, group=pg, async_op=False)   # out = this rank's chunk of sum(x)
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
