"""LLaMA: RoPE, RMSNorm, SwiGLU MLP, no biases, untied head, grouped-query attention."""
from __future__ import annotations

from .model import TransformerModel


class LlamaModel(TransformerModel):
    """`TransformerModel` for `ModelConfig(family="llama")`."""

    family = "llama"
