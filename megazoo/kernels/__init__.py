"""Fused kernels the model uses, each with a pure-PyTorch fallback.

The adapter API the model code calls (`layers/norm.py`; each dispatches on the tensor's
device and dtype):

| call | computes | fused by |
|---|---|---|
| ``layer_norm(x, weight, bias, eps)`` | LayerNorm over the last dim | Triton |
| ``rms_norm(x, weight, eps)`` | RMSNorm over the last dim | Triton |
| ``BlockCodec.encode_with_error`` / ``decode_*`` (``megazoo.compress``) | 1bit / 2bit gradient codec with error feedback | Triton (``triton_codec``) |
| ``TopKCodec.encode_with_error`` (``megazoo.compress``) | topk encoder with error feedback | Triton (``triton_topk``) |

Softmax, bias + GeLU and RoPE kernels, which no model selects, live in
``bench/experimental/kernels`` on the same dispatcher.

Every function takes ``impl=None`` (automatic, `_dispatch.py`) or a name to force one, and
computes in float32, returning the input's dtype. ``python -m megazoo.kernels`` prints which
implementation each kernel uses here, and why. Triton kernels load on the first GPU call.
"""
from .norms import fused_norm_runs, layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .report import kernel_report

__all__ = ["layer_norm", "rms_norm", "kernel_report", "fused_norm_runs", "layer_norm_reference",
           "rms_norm_reference"]
