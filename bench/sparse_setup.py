"""What the block-sparse attention benchmark and its checks share: the layouts of the sweep,
the inputs, and the path each configuration runs (built once)."""
from __future__ import annotations

import re

import torch

from megazoo.config.sparse_attention import SparseAttentionConfig
from megazoo.layers.sparse import (TILE, BlocksPlan, StridedPlan, block_mask_from_layout,
                                   build_plan, choose, token_mask)
from megazoo.layers.sparse.gather import block_masks
from megazoo.layers.sparse.rects import add_rects

MODES = ["seeds", "bslongformer", "bigbird", "fixed", "variable"]


def sparse_configs(modes, blocks, window) -> list[tuple[str, SparseAttentionConfig]]:
    """(label, config) for each mode and block: a causal window of about `window` tokens
    (fixed and variable: windows of 2 * window tokens, one global block per window / block 0);
    a mode starting with "seeds" is the seeds' section (once, block 16)."""
    out = []
    for mode in modes:
        if mode.startswith("seeds"):  # the seeds' ds_config section, DeepSpeed's defaults
            keys = {"mode": "fixed", "block": 16, "different_layout_per_head": True}
            out.append((mode, SparseAttentionConfig.from_ds_config(keys)))
            continue
        for block in blocks:
            back = max(1, window // block)  # key blocks before the diagonal one
            keys = {"mode": mode, "block": block, "different_layout_per_head": True,
                    "attention": "unidirectional"}
            if mode == "fixed":
                keys.update(num_local_blocks=max(1, 2 * window // block), num_global_blocks=1)
            elif mode == "variable":
                keys.update(local_window_blocks=[max(1, 2 * window // block)], num_random_blocks=1,
                            global_block_indices=[0])
            elif mode == "bigbird":
                keys.update(num_sliding_window_blocks=2 * back + 1, num_global_blocks=1,
                            num_random_blocks=1)
            else:
                keys.update(num_sliding_window_blocks=2 * back + 1, global_block_indices=[0])
            out.append((f"{mode}", SparseAttentionConfig.from_ds_config(keys)))
    return out


def inputs(s, args, device, dtype=torch.bfloat16, requires_grad=True):
    """(q, k, v, grad) random [s, 1, heads, head_dim]."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (s, 1, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_(requires_grad)
               for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype, generator=g)


def tile_mask(lay, block, device):
    """The BlockMask, and the fraction of 128-token tiles it computes (of all s^2 tiles).

    Every layout is looked up at 16-token granularity (the same mask), so that all blocks
    share one compiled kernel per sequence length."""
    fine = token_mask(lay, block // 16) if block > 16 else lay  # the same mask, at block 16
    mask = block_mask_from_layout(fine, 16, causal=True, device=device)
    tiles = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    return mask, tiles.item() / mask.kv_indices.shape[-2] ** 2 / mask.kv_indices.shape[1]


def gather_plan(lay, block, s, device):
    """The gather plan of a layout without rectangles (heads sharing the layout: one head)."""
    return build_plan((lay[:1] if lay.stride(0) == 0 else lay).to(device), block, s, True)


def prepare_path(label, lay, block, s, device, head_dim=128):
    """(path, block_mask, plan, tile density, why) built once: what backend "auto" runs ("tiles";
    "gather"; "rects": the gather plan with its chunk rectangles on the dense kernel), or the
    path a label ending in _tiles / _gather / _rects forces (_gather: the plan without
    rectangles; _rects: with them, where they pay, the path before the strided plan; _cN:
    with rectangles over about N query chunks), "strided" where "auto" finds the strided
    plan (its local part on the Triton kernel below block 128; "strided_flex": on
    FlexAttention, as before that kernel, forced by a label ending in _flexlocal), "blocks"
    where it takes the Triton kernel; tile density: the 128-tiles computed
    (FlexAttention's and the dense kernel's) / ((s/128)^2 heads), for "blocks" the score
    entries its chunks compute / (s^2 heads); why: the dispatch table's reason for "auto"."""
    chunks = re.fullmatch(r".*_c(\d+)", label)
    why = f"forced by the label {label}"
    if label.endswith(("_gather", "_rects")) or chunks:
        plan = gather_plan(lay, block, s, device)
        if chunks or label.endswith("_rects"):
            add_rects(plan, **({} if not chunks else dict(
                chunk=TILE * max(1, round(s / (int(chunks[1]) * TILE))), min_share=0)))
    else:
        plan = None
        if not label.endswith("_tiles"):
            found = choose(lay, block, True, s, device, head_dim=head_dim)
            plan, why = found.plan, found.reason
    if plan is None:
        mask, tiles = tile_mask(lay, block, device)
        return "tiles", mask, None, tiles, why
    if isinstance(plan, StridedPlan):
        path = "strided_flex" if label.endswith("_flexlocal") else "strided"
        return path, None, plan, strided_tiles(plan, s), why
    if isinstance(plan, BlocksPlan):
        return "blocks", None, plan, plan.pairs() / s ** 2, why
    block_masks(plan, plan.rects is not None)
    n = plan.partial.shape[1]
    path = "gather" if plan.rects is None else "rects"
    return path, None, plan, sum(plan.tiles()) / (n * n * plan.heads), why


def strided_tiles(plan: StridedPlan, s: int) -> float:
    """Share of the (s/128)^2 kernel tiles of a head that the strided plan computes: the
    local part's FlexAttention tiles and the global part's causal triangles in tile units."""
    mask, n = plan.block_mask(), -(-s // TILE)
    local = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item() / plan.rank.shape[0]
    length = plan.key_pos.shape[1]
    return (local + plan.ratio * length * (length + 1) / 2 / TILE ** 2) / (n * n)


def rect_share(plan) -> float | None:
    """Share of the plan's 128-tiles that its rectangles compute (None: no rectangles)."""
    if getattr(plan, "rects", None) is None:
        return None
    return plan.rects.pairs(plan.seq_len, plan.heads) / (sum(plan.tiles()) * TILE * TILE)


def allow_recompiles(limit: int = 256) -> None:
    """Let the compiled FlexAttention recompile per sequence length and layout shape (a sweep
    expects one compile each) instead of falling back to eager FlexAttention at dynamo's limit."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)
