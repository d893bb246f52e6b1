"""Block-sparse attention from a layout (`sparse_layouts.py`): FlexAttention with a BlockMask
on GPUs, and a dense fallback (the layout expanded to an explicit mask, float32 math) on CPU
and for checking.

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries (the package's [s, b, ...] layout, as `core_attention`) |
| k, v | [s, b, hk, d] | keys / values; hq % hk == 0 (GQA) |
| layout | bool [hq, s/block, s/block] | the tiles each query head computes (a rank's rows) |
| alibi_slopes | [hq] float32 | slopes of the heads held, by global head index |
| out | [s, b, hq, d] | attention output |

Query i of head h sees key j when layout[h, i // block, j // block] and, if causal, j <= i.
A query that sees no key outputs 0 (as in attention.py). RoPE is applied to q and k before
this call; ALiBi is a score_mod on FlexAttention (no s x s bias) and an added bias in math.

What "auto" runs on CUDA: the strided plan (`sparse_strided.py`) for causal windows with the
same global blocks in each (the fixed mode: one dense causal kernel call for the global
columns, the rest on the Triton kernel below block 128); else the Triton kernel of
`sparse_blocks.py` (backend "triton"), which walks 16-token key blocks, so random and strided
blocks cost their density. Without Triton, or with ALiBi (neither kernel adds it),
FlexAttention skips whole tiles of KERNEL_BLOCK = 128 queries x 128 keys (`tile_layout`;
"full" tiles run without a mask, "partial" ones look the layout up per element), and for
blocks below 128 the gather plan (`sparse_plan.py`, backend "gather") computes the same
function over a rearranged key axis where that costs well less (`choose_plan`).

s need not be a multiple of the block: the layout then has ceil(s / block) blocks per side
(the layout of the length rounded up to the block, as generation uses it) and its last block
is short.
"""
from __future__ import annotations

import torch

from ..config.sparse_attention import SparseAttentionConfig
from . import attention_kernels as kernels
from .attention import (AttentionRequest, check_attention_inputs, math_attention,
                        unsupported_reason)
from .sparse_blocks import (BlocksPlan, blocks_attention, build_blocks_plan,
                            strided_blocks_attention, triton_reason)
from .sparse_gather import gather_attention
from .sparse_layouts import layout as make_layout
from .sparse_plan import TILE as KERNEL_BLOCK
from .sparse_plan import build_plan, tile_block_mask, zero_pad
from .sparse_rects import add_rects
from .sparse_strided import StridedPlan, strided_attention, strided_plan

BACKENDS = ("auto", "flex", "gather", "triton", "math")
GATHER_GAIN = 0.8  # "auto" gathers when its plan costs at most this share of the tiles
GATHER_KEY_COST = 8  # cost of a tile of keys copied out of place, in computed tiles


def token_mask(block_layout: torch.Tensor, block: int) -> torch.Tensor:
    """Bool [h, s, s]: the layout expanded to tokens (no causality); for the dense fallback."""
    return block_layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def tile_layout(block_layout: torch.Tensor, block: int, causal: bool,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full), each bool [h, n, n] over kernel tiles (n = ceil(s / KERNEL_BLOCK)):
    tiles to compute with the element mask, and tiles to compute without it. seq_len: the
    real length s when the last block is short (default: nb * block); a tile holding tokens
    past it is never full."""
    if block % KERNEL_BLOCK and KERNEL_BLOCK % block:
        raise ValueError(f"sparse attention block {block} neither divides nor is a multiple of "
                         f"the kernel block {KERNEL_BLOCK}; use a power of two")
    heads, nb, _ = block_layout.shape
    s = nb * block if seq_len is None else seq_len
    n, r = -(-s // KERNEL_BLOCK), max(KERNEL_BLOCK // block, 1)  # r: layout units per tile
    units = token_mask(block_layout, max(block // KERNEL_BLOCK, 1))  # units of min(block, tile)
    grid = zero_pad(units[:, :n * r, :n * r], n * r).view(heads, n, r, n, r)
    needed, full = grid.any(dim=4).any(dim=2), grid.all(dim=4).all(dim=2)
    inside = torch.arange(1, n + 1, device=block_layout.device) * KERNEL_BLOCK <= s
    full = full & inside[:, None] & inside[None, :]
    if causal:
        lower = torch.ones(n, n, dtype=torch.bool, device=block_layout.device)
        needed = needed & lower.tril()
        full = full & lower.tril(-1)  # diagonal tiles need the token-level causal mask
    return needed & ~full, full


def _layout_mask_mod(table: torch.Tensor, unit: int, causal: bool):
    """mask_mod(b, h, q, kv): table[h, q // unit, kv // unit] (and q >= kv)."""
    last = table.shape[-1] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // unit, max=last)  # a padded short tile must not read past it
        kb = torch.clamp(kv_idx // unit, max=last)
        seen = table[h, qb, kb]
        return seen & (q_idx >= kv_idx) if causal else seen
    return mask_mod


def block_mask_from_layout(block_layout: torch.Tensor, block: int, *, causal: bool,
                           device=None, lookup_block: int | None = None,
                           seq_len: int | None = None):
    """The FlexAttention BlockMask of a layout (see the module docstring for the tiling).

    Built from the layout directly (`BlockMask.from_kv_blocks`), without evaluating the mask
    over s x s; build it once per sequence length and reuse it. The mask_mod (evaluated in
    partial tiles, and everywhere by FlexAttention's unfused eager path) looks the layout up
    at lookup_block granularity: by default the block; a smaller one that divides it gives the
    same mask from a larger table, and lets layouts of different blocks share one compiled
    kernel (the graph depends on the table's shape and the granularity). seq_len: the real
    length when the last block is short (default: nb * block).
    """
    device = block_layout.device if device is None else torch.device(device)
    heads, nb, _ = block_layout.shape
    lay = _heads_of(block_layout).to(device=device, dtype=torch.bool)
    s = nb * block if seq_len is None else seq_len
    partial, full = tile_layout(lay, block, causal, s)
    unit = block if lookup_block is None else lookup_block
    if unit < 1 or block % unit:
        raise ValueError(f"lookup_block {unit} must divide the block {block}")
    table = token_mask(lay, block // unit)
    mask_mod = _layout_mask_mod(table.expand(heads, -1, -1).contiguous(), unit, causal)
    return tile_block_mask(partial.expand(heads, -1, -1), full.expand(heads, -1, -1), mask_mod,
                           (s, s))


def _check(q, k, v, block_layout, block, alibi_slopes) -> None:
    check_attention_inputs(q, k, v, None, alibi_slopes, causal=True)  # causal: one s for all
    s, hq = q.shape[0], q.shape[2]
    nb = -(-s // block) if block > 0 else -1
    if block_layout.dtype != torch.bool or block_layout.shape != (hq, nb, nb):
        raise ValueError(f"sparse attention layout must be bool [hq, ceil(s/block), "
                         f"ceil(s/block)] = [{hq}, {nb}, {nb}] (s {s}, block {block}); got "
                         f"{block_layout.dtype} {tuple(block_layout.shape)}")


def _select(backend: str, q, k, v, alibi: bool, block: int) -> str:
    """The backend that runs: "math", "flex", "gather", or "auto" (CUDA: flex or gather)."""
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
        return backend
    if backend == "gather" and KERNEL_BLOCK % block:
        raise ValueError(f"sparse attention backend 'gather' needs a block dividing "
                         f"{KERNEL_BLOCK}, got {block}; use backend='flex' or 'auto'")
    if q.device.type == "cuda" or backend == "flex":
        if backend != "math" and reason is not None:
            raise ValueError(f"sparse attention backend {backend!r} cannot run this call: "
                             f"{reason}; use backend='math' or 'auto'")
    return backend


def _heads_of(block_layout: torch.Tensor) -> torch.Tensor:
    """The layout with one head when every head shares it (an expanded view), else itself."""
    shared = block_layout.shape[0] == 1 or block_layout.stride(0) == 0
    return block_layout[:1] if shared else block_layout


def choose_plan(block_layout, block: int, causal: bool, seq_len: int, device, *,
                alibi: bool = False, head_dim: int | None = None):
    """The strided plan where the layout is causal windows with the same global blocks in
    each (`sparse_strided.py`: one dense causal kernel call; not with ALiBi, which a dense
    kernel cannot add cheaply). Else on CUDA the Triton kernel's plan (`sparse_blocks.py`)
    where it can run the call (`triton_reason`; it beat FlexAttention's tiles at every block,
    128 included). Else, for blocks below 128, the gather plan of a layout when its cost (tiles
    computed, plus GATHER_KEY_COST per tile of keys copied out of place) is at most
    GATHER_GAIN of the kernel tiles of the layout in place, else None: gathering pays where
    shared global columns make the tiles (fixed), not where random blocks gathered per query
    tile do (their copies cost more). The plan gets its chunk rectangles (dense-kernel work,
    `sparse_rects.add_rects`) where they pay."""
    lay = _heads_of(block_layout).to(device)
    strided = None if alibi else strided_plan(lay, block, seq_len, causal)
    if strided is not None:
        return strided
    if torch.device(device).type == "cuda" and not triton_reason(device, head_dim, block, alibi):
        return build_blocks_plan(lay, block, seq_len, causal)
    if KERNEL_BLOCK % block or block == KERNEL_BLOCK:
        return None
    partial, full = tile_layout(lay, block, causal, seq_len)
    plan = build_plan(lay, block, seq_len, causal)
    cost = sum(plan.tiles()) + GATHER_KEY_COST * plan.gathered_tiles()
    if cost > GATHER_GAIN * int(partial.sum() + full.sum()):
        return None
    return add_rects(plan)


def prepare(block_layout, block: int, causal: bool, seq_len: int, device, backend: str, *,
            alibi: bool = False, head_dim: int | None = None):
    """(block_mask, plan) for backend "flex", "gather" or "auto" on `device`, one of them None:
    the gather plan for "gather" (with its rectangles where they pay: `add_rects`), and for
    "auto" where `choose_plan` gives one (for the calls with ALiBi or without, as `alibi`
    says; head_dim: the calls', for the Triton kernel's plan); the Triton kernel's plan for
    "triton"; else the BlockMask. Build it once per (s, device) and pass both to
    `sparse_attention`."""
    if backend == "triton":
        return None, build_blocks_plan(_heads_of(block_layout).to(device), block, seq_len, causal)
    if backend == "gather":
        return None, add_rects(build_plan(_heads_of(block_layout).to(device), block, seq_len,
                                          causal))
    plan = (choose_plan(block_layout, block, causal, seq_len, device, alibi=alibi,
                        head_dim=head_dim) if backend == "auto" else None)
    if plan is not None:
        return None, plan
    return block_mask_from_layout(block_layout, block, causal=causal, device=device,
                                  seq_len=seq_len), None


def sparse_attention(q, k, v, layout, block, *, causal: bool = True, scale: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, backend: str = "auto",
                     block_mask=None, plan=None) -> torch.Tensor:
    """Attention restricted to the layout's tiles (module docstring: shapes and semantics).

    backend: "flex" (FlexAttention over the layout's tiles, compiled on CUDA; eager and
    forward-only on CPU), "gather" (the gather plan: FlexAttention on CUDA, float32 math over
    the gathered keys on CPU), "triton" (`sparse_blocks.py`: CUDA, or CPU under Triton's
    interpreter), "math" (float32, an explicit [h, s, s] mask: small sizes and
    checking) or "auto" (on CUDA the gather plan when `choose_plan` gives one, else flex; math
    elsewhere; a strided plan runs `sparse_strided.py`, a Triton plan `sparse_blocks.py`).
    block_mask / plan: what `prepare`
    gives, reused across calls (built when both are None, and again with ALiBi where the plan
    is strided or Triton's: those paths have no ALiBi).
    """
    _check(q, k, v, layout, block, alibi_slopes)
    s = q.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    name = _select(backend, q, k, v, alibi_slopes is not None, block)
    if name == "math":
        mask = token_mask(layout.to(q.device), block)[None, :, :s, :s]  # [1, hq, s, s]
        return math_attention(q, k, v, causal, None, alibi_slopes, scale, 0.0, mask=mask)
    alibi = alibi_slopes is not None
    no_alibi = (StridedPlan, BlocksPlan)
    if (block_mask is None and plan is None) or (alibi and isinstance(plan, no_alibi)):
        block_mask, plan = prepare(layout, block, causal, s, q.device, name, alibi=alibi,
                                   head_dim=q.shape[-1])
    kernel = "flex" if q.device.type == "cuda" else "math"
    if isinstance(plan, BlocksPlan):
        return blocks_attention(q, k, v, plan, scale=scale)
    if isinstance(plan, StridedPlan):
        if name == "triton" or (kernel == "flex" and block < KERNEL_BLOCK and triton_reason(
                q.device, q.shape[-1], block, False) is None):  # 128: FlexAttention's tiles
            return strided_blocks_attention(q, k, v, plan, scale=scale)
        return strided_attention(q, k, v, plan, scale=scale, kernel=kernel)
    if plan is not None:
        return gather_attention(q, k, v, plan, scale=scale, alibi_slopes=alibi_slopes,
                                kernel=kernel)
    return kernels.flex_with_block_mask(q, k, v, block_mask, alibi_slopes, scale)


class SparseAttention:
    """Block-sparse attention of a layer's heads [h0, h1) out of num_heads (the rank's heads
    under tp / Ulysses), with the layout and its BlockMask built once per (s, device).

    All ranks and layers given the same config, num_heads and seed use the same pattern.
    """

    def __init__(self, config: SparseAttentionConfig, num_heads: int,
                 head_range: tuple[int, int] | None = None, *, causal: bool = True,
                 seed: int = 0, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown sparse attention backend {backend!r}; choose one of "
                             f"{BACKENDS}")
        self.config, self.num_heads, self.causal = config, num_heads, causal
        self.head_range = (0, num_heads) if head_range is None else tuple(head_range)
        self.seed, self.backend = seed, backend
        self._layouts: dict = {}
        self._prepared: dict = {}

    def layout(self, seq_len: int) -> torch.Tensor:
        """Bool [h1 - h0, nb, nb] on CPU, nb = ceil(s / block): the layout of s rounded up to
        the block (ValueError if that length does not fit the config)."""
        if seq_len not in self._layouts:
            padded = -(-seq_len // self.config.block) * self.config.block
            self._layouts[seq_len] = make_layout(self.config, self.num_heads, padded, self.seed,
                                                 causal=self.causal, heads=self.head_range)
        return self._layouts[seq_len]

    def __call__(self, q, k, v, *, alibi_slopes=None, scale=None) -> torch.Tensor:
        s, block = q.shape[0], self.config.block
        name = _select(self.backend, q, k, v, alibi_slopes is not None, block)
        alibi = alibi_slopes is not None
        key = (s, str(q.device), name, alibi)
        if name != "math" and key not in self._prepared:  # `prepare` once per (s, device)
            self._prepared[key] = prepare(self.layout(s), block, self.causal, s, q.device, name,
                                          alibi=alibi, head_dim=q.shape[-1])
        mask, plan = self._prepared.get(key, (None, None))
        return sparse_attention(q, k, v, self.layout(s), block, causal=self.causal, scale=scale,
                                alibi_slopes=alibi_slopes, backend=name, block_mask=mask,
                                plan=plan)
