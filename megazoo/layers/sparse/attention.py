"""Block-sparse attention from a layout (`layouts.py`): the call (`sparse_attention`) and the
layer (`SparseAttention`), on the path `dispatch.py` picks once.

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries (the package's [s, b, ...] layout, as `core_attention`) |
| k, v | [s, b, hk, d] | keys / values; hq % hk == 0 (GQA) |
| layout | bool [hq, s/block, s/block] | the tiles each query head computes (a rank's rows) |
| alibi_slopes | [hq] float32 | slopes of the heads held, by global head index |
| out | [s, b, hq, d] | attention output |

Query i of head h sees key j when layout[h, i // block, j // block] and, if causal, j <= i.
A query that sees no key outputs 0 (as in attention.py). RoPE is applied to q and k before
this call; ALiBi is a score_mod on FlexAttention (no s x s bias) and an added bias in math;
the strided plan and the Triton kernel have none, so a call with ALiBi takes another path.

s need not be a multiple of the block: the layout then has ceil(s / block) blocks per side
(the layout of the length rounded up to the block, as generation uses it) and its last block
is short.
"""
from __future__ import annotations

import torch

from ...config.sparse_attention import SparseAttentionConfig
from ..attention import check_attention_inputs
from .blocks import BlocksPlan
from .dispatch import BACKENDS, backend_path, given_route, route, run_route
from .layouts import layout as make_layout
from .strided import StridedPlan


def _check(q, k, v, block_layout, block, alibi_slopes) -> None:
    check_attention_inputs(q, k, v, None, alibi_slopes, causal=True)  # causal: one s for all
    s, hq = q.shape[0], q.shape[2]
    nb = -(-s // block) if block > 0 else -1
    if block_layout.dtype != torch.bool or block_layout.shape != (hq, nb, nb):
        raise ValueError(f"sparse attention layout must be bool [hq, ceil(s/block), "
                         f"ceil(s/block)] = [{hq}, {nb}, {nb}] (s {s}, block {block}); got "
                         f"{block_layout.dtype} {tuple(block_layout.shape)}")


def sparse_attention(q, k, v, layout, block, *, causal: bool = True, scale: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, backend: str = "auto",
                     block_mask=None, plan=None) -> torch.Tensor:
    """Attention restricted to the layout's tiles (module docstring: shapes and semantics).

    backend: "auto" (`dispatch.py`'s table: on CUDA the strided plan, the Triton kernel, the
    gather plan or FlexAttention's tiles; math elsewhere), "flex" (FlexAttention over the
    layout's tiles, compiled on CUDA; eager and forward-only on CPU), "gather" (the gather
    plan: FlexAttention on CUDA, float32 math over the gathered keys on CPU), "triton" (the
    Triton kernel: CUDA, or CPU under Triton's interpreter) or "math" (float32, an explicit
    [h, s, s] mask: small sizes and checking). block_mask / plan: built by the caller
    (`dispatch.route`'s plan, or its pieces) and reused across calls; a plan runs on the path
    of its type (a strided or Triton plan is rebuilt for a call with ALiBi); both None: built
    here.
    """
    _check(q, k, v, layout, block, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    alibi = alibi_slopes is not None
    name = backend_path(backend, q, k, v, alibi, block)
    if name != "math" and (block_mask is not None or plan is not None) and not (
            alibi and isinstance(plan, (StridedPlan, BlocksPlan))):
        r = given_route(plan, block_mask, name, q, block)
    else:
        r = route(layout, block, causal, q.shape[0], q.device, name, alibi=alibi,
                  head_dim=q.shape[-1])
    return run_route(r, q, k, v, layout, block, causal, scale, alibi_slopes)


class SparseAttention:
    """Block-sparse attention of a layer's heads [h0, h1) out of num_heads (the rank's heads
    under tp / Ulysses), with the layout and its route built once per (s, device).

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
        s, block, lay = q.shape[0], self.config.block, self.layout(q.shape[0])
        _check(q, k, v, lay, block, alibi_slopes)
        alibi = alibi_slopes is not None
        name = backend_path(self.backend, q, k, v, alibi, block)
        key = (s, str(q.device), name, alibi)
        if key not in self._prepared:  # the route once per (s, device)
            self._prepared[key] = route(lay, block, self.causal, s, q.device, name,
                                        alibi=alibi, head_dim=q.shape[-1])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return run_route(self._prepared[key], q, k, v, lay, block, self.causal, scale,
                         alibi_slopes)
