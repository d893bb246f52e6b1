"""Block-sparse attention at 16-token granularity on a Triton kernel (`kernels/triton_sparse.py`):
the plan (which key blocks each query tile walks, and which query blocks each key tile walks)
and the autograd functions around the kernels.

FlexAttention skips whole 128 x 128 tiles, so a layout of 16-token blocks with random or
strided blocks costs the tiles it touches, up to 8x its density per axis. Here a query tile of
BLOCK_M rows walks only the 16-token key blocks some row of it sees, BLOCK_N / 16 of them per
step, gathered from wherever they lie; a bit per (row block, key block) pair masks the rest. The
wasted work is what the tile's rows do not share (a row block's random block is computed for the
tile's other row blocks too, and masked), not the 128-tile around it.

The strided plan (`strided.py`) runs its local part here too (`strided_blocks_attention`):
the kernel masks the previous window's global keys per element, merges the dense kernel's
global part into its output, and in the backward adds that part's dq and its gathered keys'
dk, dv (summed over the residues) into its own, so the plan costs its dense kernel call plus
one pass of this kernel.

| tensor | shape | meaning |
|---|---|---|
| q | [s, b, hq, d] | queries |
| k, v | [s, b, hk, d] | keys / values (GQA: hq % hk == 0) |
| layout | bool [hp, nb, nb] | the layout at 16-token blocks, causality applied (hp: 1 or hq) |
| out | [s, b, hq, d] | attention output |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels._dispatch import interpreting, triton_module, triton_status
from .merge import rect_backward, rect_forward, rect_kernel
from .strided import StridedPlan, gathered_keys, residues

SUB = 16  # the kernel's granularity, in tokens (it receives it as a constant)
BLOCK_M = BLOCK_N = 64  # a query tile's rows and a chunk's keys (the key side: the mirror)


@dataclass
class BlocksPlan:
    """The kernel's lists for one layout and length: query side (rows) and key side (cols),
    each (count int32 [hp, tiles], index int32 [hp, tiles, chunks, per chunk], bits int64
    [hp, tiles, chunks]), walked in tiles of BLOCK_M queries and BLOCK_N keys."""

    rows: tuple
    cols: tuple
    seq_len: int
    causal: bool

    @property
    def heads(self) -> int:
        return self.rows[0].shape[0]

    def launch(self) -> dict:
        """The kernels' tile arguments for this plan (`kernels.triton_sparse`)."""
        return dict(block_m=BLOCK_M, block_n=BLOCK_N, sub=SUB, layout_heads=self.heads,
                    causal=self.causal)

    def pairs(self) -> int:
        """Score entries the kernel computes per head (of the query-side walk), for reports."""
        return int(self.rows[0].sum()) * BLOCK_M * BLOCK_N // self.heads


def triton_reason(device, head_dim: int | None, block: int, alibi: bool) -> str | None:
    """Why this module's Triton kernel cannot run a call, or None."""
    ok, why = triton_status()
    if not ok:
        return why
    if torch.device(device).type != "cuda" and not interpreting():
        return "it needs a CUDA GPU (or Triton's interpreter, TRITON_INTERPRET=1)"
    if alibi:
        return "it has no ALiBi"
    if block % SUB:
        return f"the block {block} is not a multiple of 16"
    if head_dim is None or head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"the head dim {head_dim} is not a power of two in [16, 256]"
    return None


def to_sub_blocks(block_layout: torch.Tensor, block: int) -> torch.Tensor:
    """A layout of `block`-token blocks (a multiple of 16) at 16-token granularity."""
    if block % SUB:
        raise ValueError(f"the Triton sparse attention kernel needs a block that is a multiple "
                         f"of {SUB}, got {block}")
    r = block // SUB
    return block_layout.repeat_interleave(r, dim=1).repeat_interleave(r, dim=2)


def _walk(lay: torch.Tensor, per_tile: int, per_chunk: int):
    """(count, index, bits) of tiles of `per_tile` rows of lay [hp, n, m] walking chunks of
    `per_chunk` of its columns: the columns some row of the tile sets, in order."""
    hp, n, m = lay.shape
    tiles = -(-n // per_tile)
    grid = torch.zeros(hp, tiles * per_tile, m, dtype=torch.bool, device=lay.device)
    grid[:, :n] = lay
    grid = grid.view(hp, tiles, per_tile, m)
    union = grid.any(2)  # [hp, tiles, m]
    seen = union.sum(-1)
    count = -(-seen // per_chunk)
    chunks = max(int(count.max()), 1)
    width = chunks * per_chunk
    order = torch.sort((~union).to(torch.uint8), dim=-1, stable=True).indices
    order = _pad_last(order, width)[..., :width]
    used = torch.arange(width, device=lay.device) < seen[..., None]
    index = torch.where(used, order, 0)
    pairs = grid.gather(3, index[:, :, None, :].expand(hp, tiles, per_tile, width))
    pairs = (pairs & used[:, :, None, :]).view(hp, tiles, per_tile, chunks, per_chunk)
    pairs = pairs.permute(0, 1, 3, 2, 4).reshape(hp, tiles, chunks, per_tile * per_chunk)
    bits = (pairs.long() << torch.arange(per_tile * per_chunk, device=lay.device)).sum(-1)
    return (count.to(torch.int32).contiguous(),
            index.view(hp, tiles, chunks, per_chunk).to(torch.int32).contiguous(),
            bits.contiguous())


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """x padded with zeros on its last axis to at least `width`."""
    if x.shape[-1] >= width:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], width - x.shape[-1])], dim=-1)


def walks(block_layout: torch.Tensor, block: int, seq_len: int, causal: bool, block_m: int,
          block_n: int) -> tuple:
    """(rows, cols): the query side's walk in tiles of block_m queries over chunks of block_n
    keys, and the key side's mirror, of a layout bool [hp, nb, nb] of `block`-token blocks."""
    lay = to_sub_blocks(block_layout.to(torch.bool), block)
    n = -(-seq_len // SUB)
    lay = lay[:, :n, :n]
    if causal:
        lay = lay & torch.ones(n, n, dtype=torch.bool, device=lay.device).tril()
    rm, rn = block_m // SUB, block_n // SUB
    if rm * rn > 63:
        raise ValueError(f"tiles of {block_m} x {block_n} need {rm * rn} bits per chunk; at "
                         f"most 63")
    return _walk(lay, rm, rn), _walk(lay.transpose(1, 2), rn, rm)


def build_blocks_plan(block_layout: torch.Tensor, block: int, seq_len: int,
                      causal: bool) -> BlocksPlan:
    """The plan of a layout bool [hp, nb, nb] of `block`-token blocks for length seq_len."""
    rows, cols = walks(block_layout, block, seq_len, causal, BLOCK_M, BLOCK_N)
    return BlocksPlan(rows, cols, seq_len, causal)


class _BlocksAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlocksPlan, scale: float):
        out, lse = triton_module("sparse").forward(q, k, v, plan.rows, scale=scale,
                                                   **plan.launch())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        dq, dk, dv = triton_module("sparse").backward(dout, q, k, v, out, lse, plan.rows,
                                                      plan.cols, scale=ctx.scale,
                                                      **plan.launch())
        return dq, _group_sum(dk, k.shape[2]), _group_sum(dv, k.shape[2]), None, None


def blocks_attention(q, k, v, plan: BlocksPlan, *, scale: float) -> torch.Tensor:
    """Attention of the plan's layout (module docstring: shapes) on the Triton kernel."""
    if q.shape[0] != plan.seq_len:
        raise ValueError(f"the sparse attention plan was built for s = {plan.seq_len}, got "
                         f"{q.shape[0]}")
    return _BlocksAttention.apply(q, k, v, plan, scale)


def _local_layout(plan: StridedPlan, s: int) -> torch.Tensor:
    """bool [hp, n, n] at 16-token blocks: what the strided plan's local part may see (its own
    window, and the previous window's global blocks), causal; the kernel masks the rest."""
    n, wb, dev = -(-s // SUB), plan.window // SUB, plan.rank.device
    glob = (plan.rank.view(plan.rank.shape[0], wb, SUB) >= 0).any(-1)  # [hp, wb]
    win = torch.arange(n, device=dev) // wb
    seen = glob[:, torch.arange(n, device=dev) % wb]  # [hp, n]: key block n is global
    prev = (win[:, None] == win[None, :] + 1)[None] & seen[:, None]
    lay = (win[:, None] == win[None, :])[None] | prev
    return lay & torch.ones(n, n, dtype=torch.bool, device=dev).tril()


class _StridedBlocks(torch.autograd.Function):
    """The strided plan (`strided.py`) with its local part on the Triton kernel: the
    forward merges the dense kernel's global part into the local part's output in the kernel,
    and the backward adds the dense kernel's dq and (summed over residues) dk, dv into the local
    part's gradients there, so no merge pass, zero-filled buffer or index_add remains."""

    @staticmethod
    def forward(ctx, q, k, v, plan: StridedPlan, scale: float, kind: str):
        local = strided_local(plan)
        hq, ratio, skip = q.shape[2], plan.ratio, plan.per_window
        keys, values = gathered_keys(k, plan, hq), gathered_keys(v, plan, hq)
        out_g, lse_g, aux = rect_forward(kind, residues(q, ratio, skip), keys, values, scale,
                                         causal=True)
        args = dict(local.launch(), scale=scale,
                    strided=(plan.rank.to(torch.int32), plan.window, ratio))
        out, lse = triton_module("sparse").forward(q, k, v, local.rows,
                                                   merge=(out_g, lse_g, skip), **args)
        ctx.save_for_backward(q, k, v, keys, values, out, lse)
        ctx.plan, ctx.args, ctx.aux, ctx.kind = plan, args, aux, kind
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keys, values, out, lse = ctx.saved_tensors
        plan, ratio, skip = ctx.plan, ctx.plan.ratio, ctx.plan.per_window
        s, b, hq, d = q.shape
        dout = dout.contiguous()
        lse_g = lse.view(b, hq, s // ratio, ratio)[:, :, skip:].permute(3, 0, 1, 2)
        gq, gk, gv = rect_backward(ctx.kind, residues(dout, ratio, skip),
                                   residues(q, ratio, skip), keys, values,
                                   residues(out, ratio, skip), lse_g.reshape(ratio * b, hq, -1),
                                   ctx.aux, ctx.args["scale"], causal=True)
        local = strided_local(plan)
        dq, dk, dv = triton_module("sparse").backward(dout, q, k, v, out, lse, local.rows,
                                                      local.cols, merge=(gq, gk, gv, skip),
                                                      **ctx.args)
        dk, dv = _group_sum(dk, k.shape[2]), _group_sum(dv, k.shape[2])
        return dq, dk, dv, None, None, None


def _group_sum(grad: torch.Tensor, hk: int) -> torch.Tensor:
    """A per-query-head key gradient [s, b, hq, d] summed over each GQA group: [s, b, hk, d]."""
    s, b, hq, d = grad.shape
    return grad if hq == hk else grad.view(s, b, hk, hq // hk, d).sum(3)


def strided_local(plan: StridedPlan) -> BlocksPlan:
    """The Triton kernel's lists for the strided plan's local part (built once, kept on it)."""
    if plan.local is None:
        s = plan.seq_len
        plan.local = build_blocks_plan(_local_layout(plan, s), SUB, s, True)
    return plan.local


def strided_blocks_attention(q, k, v, plan: StridedPlan, *, scale: float) -> torch.Tensor:
    """Attention of a strided plan's layout: the global part on the dense kernel (cuDNN on a
    GPU, float32 math elsewhere), the local part and the merging on the Triton kernel."""
    return _StridedBlocks.apply(q, k, v, plan, scale, rect_kernel(q))
