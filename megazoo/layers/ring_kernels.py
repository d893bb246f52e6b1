"""One block of ring attention: attention of some queries over one key/value block, returning
the output *and* its log-sum-exp, and the backward of that block given the merged output and
log-sum-exp of the whole row (the trick that lets a ring recompute each block on its own).

| tensor | shape | meaning |
|---|---|---|
| q | [b, hq, n_q, d] | queries, contiguous (ring_attention.py lays them out once) |
| k, v | [b, hk, n_k, d] | one key/value block; hq % hk == 0 (GQA: head i uses kv head i // (hq/hk)) |
| out | [b, hq, n_q, d] | this block's output (forward), the whole row's output (backward) |
| lse | [b, hq, n_q] float32 | log sum_j exp(score_ij), over this block (forward) or all blocks |
| q_pos, k_pos | [n_q], [n_k] int64 | global positions (the causal mask and ALiBi read them) |

Kernels (`BlockKernel.name`): "math" (float32 scores, everywhere; the only one that takes
ALiBi, whose bias is -slope |q_pos - k_pos|), "flash" (PyTorch's flash-attention op and its
backward op, CUDA) and "cudnn" (PyTorch's cuDNN attention op, Hopper and newer). The causal
mask of a block is "query position >= key position"; the CUDA kernels take it only for a
diagonal block (the same positions for queries and keys, is_causal=True), which is the only
masked block the load-balanced ring has. Every query row must see at least one key.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..parallel.device import compute_capability

KERNELS = ("math", "flash", "cudnn")
# SDPA's cuDNN kernel beats flash-attention 2 from Hopper on (attention.py picks it there too).
CUDNN_FIRST_CAPABILITY = (9, 0)


def pick_kernel(backend: str, device: torch.device, dtype: torch.dtype, alibi: bool) -> str:
    """The block kernel for the layer's `attention_backend`: math on CPU, for float32 and for
    ALiBi; "flash" asks for flash; otherwise cuDNN from Hopper on, else flash."""
    if backend == "math" or device.type != "cuda" or alibi:
        return "math"
    if dtype not in (torch.float16, torch.bfloat16):
        return "math"
    if backend == "flash" or compute_capability(device) < CUDNN_FIRST_CAPABILITY:
        return "flash"
    return "cudnn"


@dataclass
class BlockKernel:
    """The kernel a ring runs its blocks with, and what its forward told its backward."""

    name: str
    scale: float
    slopes: torch.Tensor | None = None
    """ALiBi slopes [hq] float32 (math only)."""
    lse_dims: int = 3
    """How many dimensions the kernel's own lse had (cuDNN may return [b, h, n, 1])."""
    rng: dict = field(default_factory=dict)
    """The CUDA kernels' philox state tensors from forward (unused without dropout)."""

    def forward(self, q, k, v, causal: bool, q_pos=None, k_pos=None):
        """out [b, hq, n_q, d] (q's dtype), lse [b, hq, n_q] float32."""
        if self.name == "math":
            return _math_forward(q, k, v, causal, q_pos, k_pos, self.slopes, self.scale)
        q = q.contiguous()  # a half of the rows is a strided view
        k, v = expand_kv(k, q.shape[1]).contiguous(), expand_kv(v, q.shape[1]).contiguous()
        if self.name == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=self.scale)
            self.rng = {"seed": res[6], "offset": res[7]}
        else:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=self.scale)
            self.rng = {"seed": res[6], "offset": res[7]}
        out, lse = res[0], res[1]
        self.lse_dims = lse.dim()
        return out, lse.reshape(q.shape[:3]).float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, q_pos=None, k_pos=None):
        """dq [b, hq, n_q, d], dk, dv [b, hk, n_k, d], all float32, for the block (q, k, v)
        of rows whose merged output is `out` with merged log-sum-exp `lse`."""
        if self.name == "math":
            return _math_backward(dout, q, k, v, out, lse, causal, q_pos, k_pos, self.slopes,
                                  self.scale)
        hk = k.shape[1]
        q, out, dout = q.contiguous(), out.contiguous(), dout.contiguous()
        ke, ve = expand_kv(k, q.shape[1]).contiguous(), expand_kv(v, q.shape[1]).contiguous()
        lse = lse.contiguous()
        lse_k = lse if self.lse_dims == 3 else lse.unsqueeze(-1)
        n_q, n_k = q.shape[2], k.shape[2]
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        seed, offset = self.rng["seed"], self.rng["offset"]
        if self.name == "flash":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse_k, cum, cum, n_q, n_k, 0.0, causal, seed, offset,
                scale=self.scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, ke, ve, out, lse_k, seed, offset, None, cum, cum, n_q, n_k, 0.0, causal,
                scale=self.scale)
        return dq.float(), sum_kv(dk.float(), hk), sum_kv(dv.float(), hk)


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[b, hk, n, d] -> [b, hq, n, d]: each kv head repeated for its hq/hk query heads."""
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)


def sum_kv(grad: torch.Tensor, hk: int) -> torch.Tensor:
    """[b, hq, n, d] -> [b, hk, n, d]: the gradient of `expand_kv`."""
    b, hq, n, d = grad.shape
    return grad if hq == hk else grad.view(b, hk, hq // hk, n, d).sum(2)


def _scores(q, k, causal, q_pos, k_pos, slopes, scale):
    """float32 scores [b, hq, n_q, n_k] with ALiBi added and masked keys at -inf."""
    scores = torch.matmul(q.float(), expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if slopes is not None or causal:
        distance = q_pos[:, None] - k_pos[None, :]  # [n_q, n_k], global positions
        if slopes is not None:
            scores = scores - slopes.float()[:, None, None] * distance.abs().float()
        if causal:
            scores = scores.masked_fill(distance < 0, float("-inf"))
    return scores


def _math_forward(q, k, v, causal, q_pos, k_pos, slopes, scale):
    scores = _scores(q, k, causal, q_pos, k_pos, slopes, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hq, n_q]
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, expand_kv(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, q_pos, k_pos, slopes, scale):
    """Flash attention's backward in float32: P = exp(S - lse), dV = P^T dO,
    dS = P (dO V^T - rowsum(dO o O)), dQ = dS K scale, dK = dS^T Q scale."""
    hq, hk = q.shape[1], k.shape[1]
    probs = torch.exp(_scores(q, k, causal, q_pos, k_pos, slopes, scale) - lse[..., None])
    dout, vf = dout.float(), expand_kv(v, hq).float()
    dv = torch.matmul(probs.transpose(-1, -2), dout)  # [b, hq, n_k, d]
    delta = (dout * out.float()).sum(-1, keepdim=True)  # [b, hq, n_q, 1]
    dscores = probs * (torch.matmul(dout, vf.transpose(-1, -2)) - delta) * scale
    dq = torch.matmul(dscores, expand_kv(k, hq).float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq, sum_kv(dk, hk), sum_kv(dv, hk)
