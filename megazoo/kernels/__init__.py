"""Fused kernels for the transformer layers, each with a pure-PyTorch fallback.

The adapter API the model code calls (each dispatches on the tensor's device and dtype):

| call | computes | fused by |
|---|---|---|
| ``scaled_masked_softmax(scores, scale, alibi_slopes=None, causal=True)`` | softmax of scaled [b, h, sq, sk] scores (+ ALiBi, causal) | Triton |
| ``layer_norm(x, weight, bias, eps)`` | LayerNorm over the last dim | Triton |
| ``rms_norm(x, weight, eps)`` | RMSNorm over the last dim | Triton |
| ``bias_gelu(x, bias, approximate="tanh")`` | gelu(x + bias), tanh or erf | Triton and CUDA C++ |
| ``apply_rope(x, cos, sin)`` | RoPE on [s, b, *heads, d] (same signature as layers.positions) | Triton |

Every function takes ``impl=None`` (automatic: the fused kernel for CUDA tensors where one
can run, else PyTorch) or ``"triton"``, ``"cuda"``, ``"torch"`` to force one. All of them
compute in float32 and return the input's dtype (bf16, fp16, fp32), forward and backward.
``python -m megazoo.kernels`` prints which implementation each kernel uses here, and why.

Nothing compiled is imported by ``import megazoo.kernels``: Triton kernels load on the first
call on a GPU, the CUDA extension on the first bias_gelu call on a GPU.
"""
from .gelu import bias_gelu, bias_gelu_reference
from .norms import fused_norm_runs, layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .report import kernel_report
from .rope import apply_rope, apply_rope_qk, rope_cos_sin, rope_reference
from .softmax import scaled_masked_softmax, softmax_reference

__all__ = [
    "scaled_masked_softmax", "layer_norm", "rms_norm", "bias_gelu", "apply_rope", "apply_rope_qk",
    "rope_cos_sin", "kernel_report", "fused_norm_runs",
    "softmax_reference", "layer_norm_reference", "rms_norm_reference", "bias_gelu_reference",
    "rope_reference",
]
