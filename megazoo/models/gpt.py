"""GPT (GPT-2/GPT-3): learned positions, LayerNorm, GeLU MLP, biases, tied embeddings."""
from __future__ import annotations

from .model import TransformerModel


class GPTModel(TransformerModel):
    """`TransformerModel` for `ModelConfig(family="gpt")`."""

    family = "gpt"
