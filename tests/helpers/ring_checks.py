"""Rank-side checks of ring attention (layers/ring_attention.py) against one process.

Every rank draws the same full q, k, v [s, b, h, d] and upstream gradient, runs the float32
reference (`math_attention`, causal, on the whole sequence) and the ring on its two chunks,
and compares its rows of the output and of the q / k / v gradients (a rank's k / v gradient
comes back to it complete after the ring's last step).

Tolerance (fp32): rtol 1e-5, atol 1e-5 x the largest entry of the expected tensor. The ring
sums the same softmax terms in another order (per block, merged by log-sum-exp); observed
differences are ~1e-7 of the largest entry, while a wrong chunk, position or accumulator moves
rows by O(1). On GPUs (bf16 inputs, the flash and cuDNN kernels against the float32 reference
on the same bf16 numbers): 2e-2 of the largest entry, bf16's rounding of the output and of
the kernels' internal P and dS (2^-8 relative, summed over a few hundred keys).
"""
import torch
import torch.distributed as dist

from megazoo.layers.attention import math_attention
from megazoo.layers.positions import alibi_slopes
from megazoo.layers.ring_attention import context_parallel_positions, ring_attention
from megazoo.layers.ring_kernels import BlockKernel, pick_kernel

# name: (query heads, kv heads, ALiBi, sequence length)
CASES = {
    "mha": (4, 4, False, 16),
    "gqa-8-per-kv": (16, 2, False, 32),
    "mqa-1-kv": (8, 1, False, 24),
    "alibi-6-heads": (6, 6, True, 16),
    "long-gqa": (4, 2, False, 512),
}
B, D = 2, 8


def _close(name, got, want, rel):
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rel * (1 + 2 * scale), f"{name}: {err} (scale {scale})"
    return err / max(scale, 1e-12)


def check_ring(device="cpu", kernel="auto", dtype=torch.float32, head_dim=D):
    """Every case on this world's ring; returns the worst relative difference. On CUDA pass
    `kernel` ("flash" / "cudnn") and dtype bfloat16 (ALiBi cases run the math kernel)."""
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    cp, rank = dist.get_world_size(), dist.get_rank()
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    worst = 0.0
    for name, (hq, hk, alibi, s) in CASES.items():
        if s % (2 * cp):
            continue
        g = torch.Generator().manual_seed(len(name))
        q, k, v = (torch.randn(s, B, h, head_dim, generator=g).to(device, dtype)
                   for h in (hq, hk, hk))
        q = q * 2  # sharper attention: a wrong key moves the output
        grad = torch.randn(s, B, hq, head_dim, generator=g).to(device, dtype)
        slopes = alibi_slopes(hq, device) if alibi else None
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = math_attention(*(t.float() for t in full), True, None, slopes, head_dim ** -0.5,
                             0.0)
        ref_grads = torch.autograd.grad(ref, full, grad.float())
        pos = context_parallel_positions(s, cp, rank, device)
        local = [t[pos].clone().requires_grad_() for t in (q, k, v)]
        name_k = pick_kernel(kernel, q.device, q.dtype, alibi)
        if kernel in ("flash", "cudnn") and not alibi:
            name_k = kernel
        block = BlockKernel(name_k, head_dim ** -0.5, slopes)
        out = ring_attention(*local, dist.group.WORLD, seq_len=s, kernel=block)
        grads = torch.autograd.grad(out, local, grad[pos])
        worst = max(worst, _close(f"{name} out", out, ref[pos], rel))
        for what, got, want in zip("qkv", grads, ref_grads):
            worst = max(worst, _close(f"{name} {name_k} d{what}", got, want[pos], rel))
    return worst
