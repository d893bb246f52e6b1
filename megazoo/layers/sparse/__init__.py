"""Block-sparse attention: layouts, the plans that run them, and the one table that picks the
path (`dispatch.py`).

| module | what |
|---|---|
| `layouts.py` | DeepSpeed's sparsity modes as bool [heads, nb, nb] layouts; `density` |
| `attention.py` | `sparse_attention` (one call) and `SparseAttention` (a layer's heads) |
| `dispatch.py` | `Route`: the path of a call and why, decided once; `choose` for "auto" |
| `tiles.py` | FlexAttention's 128-tiles of a layout and its BlockMask |
| `strided.py` | windows with shared global blocks: one dense causal call plus a local part |
| `blocks.py` | the Triton kernel's plan (16-token walks) and its autograd functions |
| `gather_plan.py`, `gather.py` | keys gathered so that FlexAttention's tiles are full |
| `rects.py`, `merge.py` | dense rectangles of the gathered keys; the log-sum-exp merge |

Imports go one way: attention -> dispatch -> (strided, blocks, gather) -> (merge, rects,
gather_plan) -> tiles; layouts stands alone.
"""
from .attention import SparseAttention, sparse_attention
from .blocks import BlocksPlan, build_blocks_plan, triton_reason
from .dispatch import BACKENDS, Route, choose, choose_plan, route
from .gather_plan import GatherPlan, build_plan
from .layouts import check_sequence, density, layout
from .strided import StridedPlan, strided_plan
from .tiles import TILE, block_mask_from_layout, tile_layout, token_mask

__all__ = ["SparseAttention", "sparse_attention", "BlocksPlan", "build_blocks_plan",
           "triton_reason", "BACKENDS", "Route", "choose", "choose_plan", "route", "GatherPlan",
           "build_plan", "check_sequence", "density", "layout", "StridedPlan", "strided_plan",
           "TILE", "block_mask_from_layout", "tile_layout", "token_mask"]
