"""Shared test fixtures: the tiny model configurations the tests build.

``tiny_config(family, **fields)`` is a 2-layer, h = 64, 8-head model with a 300-token
vocabulary (padded to 384 at tp = 1, 512 at tp = 2) and 64 positions; any ModelConfig field
overrides its default. Family names may carry a suffix for the attention layout:

* ``"llama"``: grouped-query attention with half as many kv heads as heads (each kv head
  serves two query heads, so tp = 2 splits the kv heads too);
* ``"llama-mqa"``: one kv head, which every tp rank then holds a copy of (the replicated-kv
  QKV layout).
"""
from __future__ import annotations

from megazoo.models import ModelConfig

VOCAB = 300
TINY_FIELDS = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=VOCAB,
                   max_position_embeddings=64)


def tiny_config(family: str = "gpt", **fields) -> ModelConfig:
    """A tiny `family` model (see the module docstring); `fields` override ModelConfig fields."""
    base, _, variant = family.partition("-")
    if variant not in ("", "mqa"):
        raise ValueError(f"unknown family variant {family!r}: use '<family>' or '<family>-mqa'")
    merged = {**TINY_FIELDS, **fields}
    if "num_key_value_heads" not in merged and base == "llama":
        merged["num_key_value_heads"] = 1 if variant else merged["num_attention_heads"] // 2
    elif variant and "num_key_value_heads" not in merged:
        merged["num_key_value_heads"] = 1
    return ModelConfig(family=base, **merged)
