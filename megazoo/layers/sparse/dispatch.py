"""The one place block-sparse attention picks its path: a `Route` (the path, one line saying
why, and the plan it runs) decided once per (length, device, backend, ALiBi) and run by
`run_route`; error messages and the benchmark read the same reason.

| path | runs | backend "auto" takes it (CUDA, FlexAttention able to run the call) |
|---|---|---|
| math | float32 softmax with the layout expanded to a mask | off CUDA, or FlexAttention cannot run the call |
| strided_blocks | `strided.py`'s plan: global part one dense causal call, local part and merge on the Triton kernel | causal windows with the same global blocks in each, no ALiBi, block below 128, Triton runs |
| strided | the same plan, local part on FlexAttention (float32 math off CUDA) | the same layouts at block 128, or without Triton |
| blocks | the Triton kernel's walk of 16-token blocks (`blocks.py`) | Triton runs the call (no ALiBi, block a multiple of 16, head dim a power of two) |
| gather | the gather plan over rearranged keys (`gather_plan.py`), rectangles where they pay | block below 128 dividing it, costing at most GATHER_GAIN of the tiles |
| flex | FlexAttention over the layout's own 128-tiles (`tiles.py`) | otherwise (ALiBi included) |

An explicit backend ("flex", "gather", "triton", "math") takes its path or raises a one-line
ValueError naming the reason; a plan built by the caller runs on the path of its type.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import attention_kernels as kernels
from ..attention import AttentionRequest, math_attention, unsupported_reason
from .blocks import BlocksPlan, blocks_attention, build_blocks_plan, strided_blocks_attention
from .blocks import triton_reason
from .gather import gather_attention
from .gather_plan import build_plan
from .rects import add_rects
from .strided import StridedPlan, strided_attention, strided_plan
from .tiles import TILE, block_mask_from_layout, heads_of, tile_layout, token_mask

BACKENDS = ("auto", "flex", "gather", "triton", "math")
GATHER_GAIN = 0.8  # "auto" gathers when its plan costs at most this share of the tiles
GATHER_KEY_COST = 8  # cost of a tile of keys copied out of place, in computed tiles


@dataclass(frozen=True)
class Route:
    """The path of a call, why, and what it runs: a StridedPlan, BlocksPlan, GatherPlan, the
    BlockMask ("flex"), or None ("math"; "flex" before its BlockMask is built)."""

    path: str
    reason: str
    plan: object = None


def _strided_path(plan: StridedPlan, device, head_dim, block: int, backend: str) -> Route:
    """A strided plan's route: its local part on the Triton kernel where that runs below
    block 128 (at 128 FlexAttention's tiles fit the windows), else on FlexAttention."""
    why = triton_reason(device, head_dim, block, False)
    on_cuda = torch.device(device).type == "cuda"
    if backend == "triton" or (on_cuda and block < TILE and why is None):
        return Route("strided_blocks", "windows with shared global blocks: one dense causal "
                     "call, the local part on the Triton kernel", plan)
    return Route("strided", "windows with shared global blocks: one dense causal call, the "
                 f"local part on FlexAttention ({why or f'block {block}: whole tiles'})", plan)


def choose(block_layout, block: int, causal: bool, seq_len: int, device, *, alibi: bool = False,
           head_dim: int | None = None) -> Route:
    """What backend "auto" runs on `device` (module docstring's table, from the strided row
    down); the plan built, a "flex" route's BlockMask not yet. The gather plan's cost: tiles
    computed plus GATHER_KEY_COST per tile of keys copied out of place; gathering pays where
    shared global columns make the tiles (fixed), not where random blocks gathered per query
    tile do."""
    lay = heads_of(block_layout).to(device)
    strided = None if alibi else strided_plan(lay, block, seq_len, causal)
    if strided is not None:
        return _strided_path(strided, device, head_dim, block, "auto")
    why = triton_reason(device, head_dim, block, alibi)
    if torch.device(device).type != "cuda":
        why = "not on CUDA"
    elif why is None:
        return Route("blocks", "the Triton kernel walks the layout's 16-token blocks",
                     build_blocks_plan(lay, block, seq_len, causal))
    if TILE % block or block == TILE:
        return Route("flex", f"the Triton kernel cannot run it ({why}); block {block} fills "
                     "FlexAttention's tiles")
    partial, full = tile_layout(lay, block, causal, seq_len)
    plan = build_plan(lay, block, seq_len, causal)
    cost = sum(plan.tiles()) + GATHER_KEY_COST * plan.gathered_tiles()
    if cost > GATHER_GAIN * int(partial.sum() + full.sum()):
        return Route("flex", f"the Triton kernel cannot run it ({why}); gathering would cost "
                     f"{cost} tiles against {int(partial.sum() + full.sum())}")
    return Route("gather", f"the Triton kernel cannot run it ({why}); gathering costs {cost} "
                 f"tiles against {int(partial.sum() + full.sum())}", add_rects(plan))


def choose_plan(block_layout, block: int, causal: bool, seq_len: int, device, *,
                alibi: bool = False, head_dim: int | None = None):
    """The plan of `choose`'s route (None where it is FlexAttention over the tiles)."""
    return choose(block_layout, block, causal, seq_len, device, alibi=alibi,
                  head_dim=head_dim).plan


def backend_path(backend: str, q, k, v, alibi: bool, block: int) -> str:
    """"math", "auto" (CUDA, FlexAttention able to run the call) or the explicit backend if it
    can run the call; else a one-line ValueError saying why and what to use."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sparse attention backend {backend!r}; choose one of {BACKENDS}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    req = AttentionRequest(q.device.type, q.dtype, q.shape[-1], alibi, False, False, grad)
    reason = unsupported_reason("flex", req)
    if backend == "auto":
        return "auto" if q.device.type == "cuda" and reason is None else "math"
    if backend == "triton":
        why = triton_reason(q.device, q.shape[-1], block, alibi)
        if why is not None:
            raise ValueError(f"sparse attention backend 'triton' cannot run this call: {why}; "
                             f"use backend='auto' or 'math'")
    if backend == "gather" and TILE % block:
        raise ValueError(f"sparse attention backend 'gather' needs a block dividing {TILE}, "
                         f"got {block}; use backend='flex' or 'auto'")
    if backend in ("flex", "gather") and (q.device.type == "cuda" or backend == "flex"):
        if reason is not None:
            raise ValueError(f"sparse attention backend {backend!r} cannot run this call: "
                             f"{reason}; use backend='math' or 'auto'")
    return backend


def route(block_layout, block: int, causal: bool, seq_len: int, device, backend: str, *,
          alibi: bool = False, head_dim: int | None = None) -> Route:
    """The route of a call whose `backend_path` is `backend`, its plan or BlockMask built
    (once per (s, device): keep it)."""
    if backend == "math":
        return Route("math", "float32 math with the layout as a mask (off CUDA, or "
                     "FlexAttention cannot run the call)")
    lay = heads_of(block_layout).to(device)
    if backend == "triton":
        return Route("blocks", "backend 'triton'", build_blocks_plan(lay, block, seq_len, causal))
    if backend == "gather":
        return Route("gather", "backend 'gather'", add_rects(build_plan(lay, block, seq_len,
                                                                        causal)))
    found = (choose(block_layout, block, causal, seq_len, device, alibi=alibi,
                    head_dim=head_dim) if backend == "auto" else Route("flex", "backend 'flex'"))
    if found.path != "flex":
        return found
    mask = block_mask_from_layout(block_layout, block, causal=causal, device=device,
                                  seq_len=seq_len)
    return Route("flex", found.reason, mask)


def given_route(plan, block_mask, backend: str, q, block: int) -> Route:
    """The route of a plan or BlockMask the caller built (`route`, or its pieces)."""
    if isinstance(plan, BlocksPlan):
        return Route("blocks", "the caller's Triton plan", plan)
    if isinstance(plan, StridedPlan):
        return _strided_path(plan, q.device, q.shape[-1], block, backend)
    if plan is not None:
        return Route("gather", "the caller's gather plan", plan)
    return Route("flex", "the caller's BlockMask", block_mask)


def run_route(r: Route, q, k, v, block_layout, block: int, causal: bool, scale: float,
              alibi_slopes) -> torch.Tensor:
    """The attention output of q, k, v [s, b, h, d] on route r."""
    kernel = "flex" if q.device.type == "cuda" else "math"
    if r.path == "math":
        mask = token_mask(block_layout.to(q.device), block)[None, :, :q.shape[0], :q.shape[0]]
        return math_attention(q, k, v, causal, None, alibi_slopes, scale, 0.0, mask=mask)
    if r.path == "blocks":
        return blocks_attention(q, k, v, r.plan, scale=scale)
    if r.path == "strided_blocks":
        return strided_blocks_attention(q, k, v, r.plan, scale=scale)
    if r.path == "strided":
        return strided_attention(q, k, v, r.plan, scale=scale, kernel=kernel)
    if r.path == "gather":
        return gather_attention(q, k, v, r.plan, scale=scale, alibi_slopes=alibi_slopes,
                                kernel=kernel)
    return kernels.flex_with_block_mask(q, k, v, r.plan, alibi_slopes, scale)
