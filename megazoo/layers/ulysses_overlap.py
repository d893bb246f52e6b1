"""Ulysses' all-to-alls overlapped with the QKV and output projections, chunk by chunk of kv
groups (`tp_overlap.chunk_pipeline`, the loop tensor parallelism uses).

The fused QKV rows of a tp rank are laid out destination by destination (sp rank j gets KS
whole kv groups, f = KS (GS + 2) d rows: heads.py), so chunk c of every destination - kv
groups [c KS/k, (c+1) KS/k) - is k-th of each destination's rows. `_ProjectToHeads` computes
x W_c^T straight into chunk c's all-to-all send buffer and starts the all-to-all while chunk
c+1 multiplies; `_ProjectFromHeads` multiplies each chunk's received context by its columns of the
output weight while the next chunk's second all-to-all travels. Backward mirrors both: the
output gradient's chunks multiply by the weight while earlier chunks travel back; the QKV
gradient's chunks arrive while the previous chunk's weight-gradient GEMMs run. The attention between them is `UlyssesAttention.local`,
unchanged (all heads in one call). With k = 1 this is the plain Ulysses path (one all-to-all
each way, the send buffer written by the GEMM instead of a permuting copy).

| tensor | shape (sp = n, k chunks) |
|---|---|
| x (input) | [s/n, b, h]: the QKV projection's input (tp-gathered under Megatron SP) |
| qkv weight | [n f, h], f = KS (GS + 2) d; chunk c of destination j: rows j f + c f/k, + f/k |
| qkv_heads | [s, b, f]: the full sequence of this rank's kv groups (chunk c at columns c f/k) |
| context | [s, b, o], o = KS GS d: attention output of this rank's heads |
| dense weight | [h_out, n o]; chunk c of source j: columns j o + c o/k, + o/k |
| y_partial (output) | [s/n, b, h_out]: before the tp reduction and the dense bias |

Rounding: the output projection sums over chunks and sources (k n GEMMs accumulated in fp32,
rounded once) instead of one GEMM, so it agrees with the plain path to rounding, not bit for
bit; the gradients are the same GEMMs on the same numbers (the QKV input gradient is one GEMM
over the reassembled gradient, after the weight gradient's chunks overlapped the transfers).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import Group, group_size, process_group
from .tp_overlap import chunk_pipeline
from .wgrad import add_to_main_grad, fuses_wgrad


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, group: Group):
    return dist.all_to_all_single(recv, send, group=process_group(group), async_op=True)


def _weight_result(weight: torch.Tensor, dw: torch.Tensor | None):
    """What backward returns for the weight: dw, or dw added into the owner's main_grad."""
    if dw is None or not fuses_wgrad(weight):
        return dw
    return add_to_main_grad(weight, dw)


class _ProjectToHeads(torch.autograd.Function):
    """forward: x W^T + b per chunk into the send buffer, all-to-all sequence -> heads;
    backward: all-to-all heads -> sequence per chunk, its input / weight / bias gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, k):
        n, (s_l, b) = group_size(group), x.shape[:2]
        f = weight.shape[0] // n
        fc = f // k
        recvs = []

        def compute(c):
            send = x.new_empty(n, s_l, b, fc)  # [destination, s/n, b, fc]
            for j in range(n):
                rows = slice(j * f + c * fc, j * f + (c + 1) * fc)
                torch.matmul(x, weight[rows].t(), out=send[j])
                if bias is not None:
                    send[j].add_(bias[rows])
            return send

        def send(c, buffer):
            recvs.append(torch.empty_like(buffer))  # [source, s/n, b, fc] = [s, b, fc]
            return _all_to_all(recvs[-1], buffer, group)

        chunk_pipeline(k, compute, send=send).wait()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.k, ctx.has_bias = group, k, bias is not None
        if k == 1:
            return recvs[0].view(n * s_l, b, f)
        out = x.new_empty(n * s_l, b, k, fc)
        for c, recv in enumerate(recvs):
            out[:, :, c] = recv.view(n * s_l, b, fc)
        return out.view(n * s_l, b, f)

    @staticmethod
    def backward(ctx, grad_heads):
        x, weight = ctx.saved_tensors
        n, k, (s_l, b) = group_size(ctx.group), ctx.k, x.shape[:2]
        f = weight.shape[0] // n
        fc = f // k
        g = grad_heads.contiguous().view(n * s_l, b, k, fc)
        x2 = x.reshape(-1, x.shape[-1])
        dqkv = x.new_empty(s_l * b, n * f)  # this shard's gradient of x W^T + b
        dw = torch.empty_like(weight) if weight.requires_grad else None
        pending = {}

        def fetch(c):
            send = g[:, :, c].contiguous() if k > 1 else g.view(n * s_l, b, fc)
            pending[c] = torch.empty_like(send)  # [feature block j, s/n, b, fc]
            return _all_to_all(pending[c], send, ctx.group)

        def compute(c):  # the weight gradient's rows of chunk c, while chunk c+1 travels
            recv = pending.pop(c).view(n, s_l * b, fc)
            for j in range(n):
                rows = slice(j * f + c * fc, j * f + (c + 1) * fc)
                dqkv[:, rows] = recv[j]
                if dw is not None:
                    torch.matmul(recv[j].t(), x2, out=dw[rows])

        chunk_pipeline(k, compute, fetch=fetch)
        dx = (dqkv @ weight).view_as(x)
        db = dqkv.sum(0) if ctx.has_bias else None
        return dx, _weight_result(weight, dw), db, None, None


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 for 16-bit a, b (one rounding at the end, as one GEMM)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # no mixed-dtype addmm on the host
        acc.add_((a @ b).float())


class _ProjectFromHeads(torch.autograd.Function):
    """forward: all-to-all heads -> sequence per chunk, each chunk times its columns of the
    dense weight; backward: the chunks' gradients (times the weight) sent back heads-ward."""

    @staticmethod
    def forward(ctx, context, weight, group, k):
        n, s, b = group_size(group), context.shape[0], context.shape[1]
        s_l, o = s // n, context.shape[-1]
        oc = o // k
        parts = context.view(s, b, k, oc)
        acc = torch.float32 if context.dtype in (torch.bfloat16, torch.float16) else context.dtype
        y = context.new_zeros(s_l * b, weight.shape[0], dtype=acc)
        recvs = []

        def fetch(c):
            send = parts[:, :, c].contiguous() if k > 1 else context.contiguous()
            recvs.append(torch.empty_like(send))  # [source j, s/n, b, oc]
            return _all_to_all(recvs[-1], send, group)

        def compute(c):
            recv = recvs[c].view(n, s_l * b, oc)
            for j in range(n):
                _accumulate(y, recv[j], weight[:, j * o + c * oc:j * o + (c + 1) * oc].t())

        chunk_pipeline(k, compute, fetch=fetch)
        ctx.save_for_backward(weight, *recvs)
        ctx.group, ctx.k, ctx.shape = group, k, (s, b, o)
        return y.to(context.dtype).view(s_l, b, -1)

    @staticmethod
    def backward(ctx, dy):
        weight, *recvs = ctx.saved_tensors
        n, k, (s, b, o) = group_size(ctx.group), ctx.k, ctx.shape
        s_l, oc = s // n, o // k
        dy2 = dy.reshape(s_l * b, -1)
        dw = torch.empty_like(weight) if weight.requires_grad else None
        grads = []

        def compute(c):
            send = dy.new_empty(n, s_l * b, oc)  # [destination j, s/n b, oc]
            for j in range(n):
                cols = slice(j * o + c * oc, j * o + (c + 1) * oc)
                torch.matmul(dy2, weight[:, cols], out=send[j])
                if dw is not None:
                    torch.matmul(dy2.t(), recvs[c].view(n, s_l * b, oc)[j], out=dw[:, cols])
            return send

        def send(c, buffer):
            grads.append(torch.empty_like(buffer))  # [source, s/n b, oc] = [s, b, oc]
            return _all_to_all(grads[-1], buffer, ctx.group)

        chunk_pipeline(k, compute, send=send).wait()
        if k == 1:
            grad_context = grads[0].view(s, b, o)
        else:
            grad_context = dy.new_empty(s, b, k, oc)
            for c, grad in enumerate(grads):
                grad_context[:, :, c] = grad.view(s, b, oc)
            grad_context = grad_context.view(s, b, o)
        return grad_context, _weight_result(weight, dw), None, None


def project_to_heads(x, weight, bias, group: Group, k: int) -> torch.Tensor:
    """x [s/n, b, h] -> qkv_heads [s, b, f] (module docstring)."""
    return _ProjectToHeads.apply(x, weight, bias, group, k)


def project_from_heads(context, weight, group: Group, k: int) -> torch.Tensor:
    """context [s, b, o] -> y_partial [s/n, b, h_out] (module docstring)."""
    return _ProjectFromHeads.apply(context, weight, group, k)
