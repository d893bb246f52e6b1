"""Attention computed in parts and merged exactly by log-sum-exp (`merge_parts`, the one merge
of the package; the Triton kernel does the same sum in place), forward and backward: the
rectangles of `rects.py` on a dense kernel merged with the FlexAttention part (`merge_rects`).
The dense kernel's calls (`rect_forward` / `rect_backward`) also serve `strided.py`, causal,
and its merge and the Flex part's gradients (`flex_grads`) go through the one compile cache
(`compiled`).

| tensor | shape | meaning |
|---|---|---|
| q | [b, hq, s, d] | queries |
| keys, values | [b, hk', W, d] | segment 2 of the gathered keys (hk' = hq, or hk when grouped) |
| out_f, lse_f | [b, hq, s, d], float32 [b, hq, s] | the FlexAttention part (lse -inf: no key) |
| out | [b, hq, s, d] | the merged attention output |

Forward: per chunk, each rectangle r gives (O_r, L_r) over its keys; with the Flex part f,
L = log sum_i exp(L_i) and O = sum_i w_i O_i, w_i = exp(L_i - L): the softmax over the union
of the key sets, since each pair is in exactly one part.

Backward, given dO (D = rowsum(dO * O) with the merged O): softmax attention's gradient is
dS = P * (dP - D) with P = exp(S - L), dP = dO V^T, and the parts' scores are disjoint, so
1. each rectangle: the dense kernel's own backward, given the MERGED O and L of its rows
   (it forms P = exp(S - L) and D from O and dO itself), returns exactly its dq, dk, dv;
2. the Flex part: d out_f = w_f dO and d lse_f = w_f (rowsum(dO * out_f) - D). Flex's
   backward then forms P_f * (w_f dP_f - w_f rowsum(dO * out_f) + d lse_f)
   = w_f P_f * (dP_f - D), and w_f P_f = exp(S - lse_f + lse_f - L) = exp(S - L).
A row the Flex part gives no key (lse_f = -inf) has w_f = 0, not NaN.

Kernels (`rect_kernel`): "cudnn" (torch's cuDNN attention ops), "flash" (torch's flash ops,
where cuDNN is off) and "math" (float32, written out: CPU, float32 inputs, checks).
"""
from __future__ import annotations

import functools

import torch


def rect_kernel(q: torch.Tensor) -> str:
    """The dense kernel for the rectangles of q's device and dtype."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return "math"
    return "cudnn" if torch.backends.cuda.cudnn_sdp_enabled() else "flash"


def _views_or_copies(op, views: tuple, *rest, **keywords):
    """op(*views, *rest): on the strided views as given (slices of larger tensors: the
    kernels take their strides, so no copy per chunk), and on contiguous copies where the
    kernel refuses them."""
    try:
        return op(*views, *rest, **keywords)
    except RuntimeError:
        return op(*(t.contiguous() for t in views), *rest, **keywords)


def _causal_scores(scores: torch.Tensor, causal: bool) -> torch.Tensor:
    """Scores [..., n, n] with the keys after each query masked (causal), else as given."""
    if not causal:
        return scores
    n = scores.shape[-1]
    above = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(above, float("-inf"))


def rect_forward(kind: str, q, k, v, scale: float, causal: bool = False):
    """Attention of q [b, h, n, d] over k, v [b, h, m, d], non-causal, or causal with n = m:
    (out, float32 lse [b, h, n], what the backward needs)."""
    b, h, n, _ = q.shape
    if kind == "cudnn":
        res = _views_or_copies(torch.ops.aten._scaled_dot_product_cudnn_attention, (q, k, v),
                               None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(b, h, n), (res[1].shape, *res[2:8])
    if kind == "flash":
        res = _views_or_copies(torch.ops.aten._scaled_dot_product_flash_attention, (q, k, v),
                               0.0, causal, False, scale=scale)
        return res[0], res[1][:, :, :n], (res[1].shape, *res[2:8])
    scores = _causal_scores(q.float() @ k.float().transpose(-1, -2) * scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype), lse, ()


def rect_backward(kind: str, dout, q, k, v, out, lse, aux, scale: float, causal: bool = False):
    """(dq, dk, dv) of one rectangle given the merged out [b, h, n, d] and lse [b, h, n]."""
    if kind == "cudnn":
        shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        stats = lse.reshape(shape).contiguous()
        return _views_or_copies(torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
                                (dout, q, k, v, out), stats, seed, offset, None, cum_q, cum_k,
                                max_q, max_k, 0.0, causal, scale=scale)
    if kind == "flash":
        shape, cum_q, cum_k, max_q, max_k, rng, unused = aux
        stats = lse.new_full(shape, float("inf"))  # padded rows (if any) see no key
        stats[:, :, :lse.shape[2]] = lse
        return _views_or_copies(torch.ops.aten._scaled_dot_product_flash_attention_backward,
                                (dout, q, k, v, out), stats, cum_q, cum_k, max_q, max_k, 0.0,
                                causal, rng, unused, scale=scale)
    qf, kf, vf, gf = q.float(), k.float(), v.float(), dout.float()
    scores = _causal_scores(qf @ kf.transpose(-1, -2) * scale, causal)
    probs = torch.exp(scores - lse[..., None])  # [b, h, n, m]
    dp = gf @ vf.transpose(-1, -2)
    ds = probs * (dp - (gf * out.float()).sum(-1, keepdim=True))
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, probs.transpose(-1, -2) @ gf


def _weight(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse), 0 where the part saw no key (also when lse is -inf)."""
    return torch.where(lse_part == float("-inf"), 0.0, torch.exp(lse_part - lse))


def merge_parts(outs: list, lses: list):
    """(out, lse): attention parts over disjoint key sets merged, float32 math: L = log sum_i
    exp(L_i), O = sum_i exp(L_i - L) O_i, in the first part's dtype. A row no part sees keeps
    lse -inf and output 0; a part without keys for a row (lse -inf) weighs 0 there."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = _weight(lses[0], lse)[..., None] * outs[0].float()
    for o, l in zip(outs[1:], lses[1:]):
        out = out + _weight(l, lse)[..., None] * o.float()
    return out.to(outs[0].dtype), lse


def _merge_rects(out_f, lse_f, outs: list, lses: list):
    """The Flex part merged with the rectangles' slots over whole [b, h, s] rows; a row that no
    rectangle touches keeps (out_f, lse_f) exactly (its rectangle slots hold lse -inf)."""
    return merge_parts([out_f, *outs], [lse_f, *lses])


def flex_grads(dout, out, lse, out_f, lse_f):
    """(d out_f, d lse_f) given dO and the merged (out, lse) (module docstring, step 2)."""
    w = _weight(lse_f, lse)
    dot = (dout.float() * out.float()).sum(-1)  # D
    dot_f = (dout.float() * out_f.float()).sum(-1)
    return (w[..., None] * dout.float()).to(out_f.dtype), w * (dot_f - dot)


@functools.lru_cache(maxsize=8)
def compiled(fn, on_cuda: bool):
    """fn compiled on CUDA (one fused pass over the rows instead of a dozen full-size
    temporaries), eager elsewhere; the package's one compile cache."""
    return torch.compile(fn, dynamic=False) if on_cuda else fn


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hk, m, d] -> [b, hk * groups, m, d] (query head h reads kv head h // g); x itself
    (a view) for groups = 1."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def group_sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, hk * groups, m, d] -> [b, hk, m, d]: the expansion's gradient."""
    b, h, m, d = x.shape
    return x.reshape(b, h // groups, groups, m, d).sum(2, dtype=torch.float32) if groups > 1 else x


class _RectMerge(torch.autograd.Function):
    """forward: the Flex part merged with the rectangles; backward: module docstring. The
    rectangles run per chunk; the merge and the Flex part's gradients run once over all rows
    (rectangle j of each chunk writes slot j: rows without one keep lse -inf there)."""

    @staticmethod
    def forward(ctx, q, keys, values, out_f, lse_f, rects, scale, kind):
        groups, (b, h, s, d) = q.shape[1] // keys.shape[1], q.shape
        chunks = rects.chunks(s)
        slots = max((len(runs) for _, runs in chunks), default=0)
        outs = [out_f.new_zeros(b, h, s, d) for _ in range(slots)]
        lses = [lse_f.new_full((b, h, s), float("-inf")) for _ in range(slots)]
        aux = []
        for (q0, q1), runs in chunks:
            qc = q[:, :, q0:q1]
            for j, (k0, k1) in enumerate(runs):
                o, l, a = rect_forward(kind, qc, expand_heads(keys[:, :, k0:k1], groups),
                                       expand_heads(values[:, :, k0:k1], groups), scale)
                outs[j][:, :, q0:q1] = o
                lses[j][:, :, q0:q1] = l
                aux.append(a)
        out, lse = compiled(_merge_rects, q.is_cuda)(out_f, lse_f, outs, lses)
        ctx.save_for_backward(q, keys, values, out_f, lse_f, out, lse)
        ctx.rects, ctx.scale, ctx.kind, ctx.aux = rects, scale, kind, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, keys, values, out_f, lse_f, out, lse = ctx.saved_tensors
        groups, aux = q.shape[1] // keys.shape[1], iter(ctx.aux)
        dout = dout.contiguous()
        d_out_f, d_lse_f = compiled(flex_grads, q.is_cuda)(dout, out, lse, out_f, lse_f)
        dq = torch.zeros_like(q)
        dk = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        dv = torch.zeros_like(dk)
        for (q0, q1), runs in ctx.rects.chunks(q.shape[2]):
            do, o, qc = dout[:, :, q0:q1], out[:, :, q0:q1], q[:, :, q0:q1]  # views
            total = lse[:, :, q0:q1].contiguous()
            for k0, k1 in runs:
                gq, gk, gv = rect_backward(ctx.kind, do, qc,
                                           expand_heads(keys[:, :, k0:k1], groups),
                                           expand_heads(values[:, :, k0:k1], groups), o, total,
                                           next(aux), ctx.scale)
                dq[:, :, q0:q1] += gq
                dk[:, :, k0:k1] += group_sum_heads(gk, groups)  # float32 += bf16: one pass
                dv[:, :, k0:k1] += group_sum_heads(gv, groups)
        return dq, dk.to(keys.dtype), dv.to(values.dtype), d_out_f, d_lse_f, None, None, None


def merge_rects(q, keys, values, out_f, lse_f, rects, scale: float, kind: str):
    """The attention output: the Flex part (out_f, lse_f) merged with the rectangles of
    `rects` over segment 2 `keys` / `values` (module docstring: shapes), computed by `kind`."""
    return _RectMerge.apply(q, keys, values, out_f, lse_f, rects, scale, kind)
