"""BLOOM: ALiBi positions (no position table), an embedding LayerNorm, GeLU MLP, biases,
tied embeddings, a 250,880-token vocabulary."""
from __future__ import annotations

from .model import TransformerModel


class BloomModel(TransformerModel):
    """`TransformerModel` for `ModelConfig(family="bloom")`."""

    family = "bloom"
