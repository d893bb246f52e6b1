"""Fused kernels kept outside the library: no model selects them (bench/README.md has what
they measured). Softmax, bias + GeLU and RoPE, each with its PyTorch fallback, dispatched by
`megazoo.kernels._dispatch` like the library's norms:

    from bench.experimental import kernels as X
    X.bias_gelu(x, bias), X.scaled_masked_softmax(scores, scale), X.apply_rope(x, cos, sin)
"""
from .gelu import bias_gelu, bias_gelu_reference
from .rope import apply_rope, apply_rope_qk, rope_cos_sin, rope_reference
from .softmax import scaled_masked_softmax, softmax_reference

__all__ = ["bias_gelu", "bias_gelu_reference", "apply_rope", "apply_rope_qk", "rope_cos_sin",
           "rope_reference", "scaled_masked_softmax", "softmax_reference"]
