"""The flat all-gather and reduce-scatter under their current torch names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single`
/ `reduce_scatter_single` and made the old names print a FutureWarning; torch 2.11 (the GPU
image) has only the old names. The names are looked up once here, by feature, so every
caller uses the current one where it exists and nothing warns.

    all_gather_flat(out, x, group=pg, async_op=False)       # out = cat of every rank's x
    reduce_scatter_flat(out, x, group=pg, async_op=False)   # out = this rank's chunk of sum(x)
"""
from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
