"""Parameters of a model: analytic count and full names (their shard layout is
`megazoo.layers.sharding`, the gradient contract `megazoo.training.gradients`)."""
from __future__ import annotations

import torch

from ..config.model import ModelConfig


def parameter_parts(config: ModelConfig, tp: int = 1, *, padded: bool = True) -> dict[str, int]:
    """The model's parameters by part, whole (not per rank), vocabulary padded as at `tp`.

    layer_sharded: the parameters of one block split over tp (qkv, dense, MLP weights, the
    column-parallel biases); layer_replicated: those every tp rank holds whole (norms, the
    row-parallel biases); embedding: word rows + positions + BLOOM's embedding norm; vocab:
    the word rows alone (the untied head has as many); norm: one norm (the final one).
    """
    h, ffn = config.hidden_size, config.ffn_hidden_size
    kv = config.num_key_value_heads * config.head_dim
    norm = 2 * h if config.norm == "layernorm" else h
    swiglu = config.activation == "swiglu"
    sharded = h * (h + 2 * kv) + h * h + (3 if swiglu else 2) * h * ffn
    sharded += (h + 2 * kv) * config.qkv_bias + (2 if swiglu else 1) * ffn * config.mlp_bias
    replicated = 2 * norm + h * config.dense_bias + h * config.mlp_bias
    vocab = (config.padded_vocab(tp) if padded else config.vocab_size) * h
    embedding = vocab + norm * config.embedding_layernorm
    if config.position_embedding == "learned":
        embedding += config.max_position_embeddings * h
    return dict(layer_sharded=sharded, layer_replicated=replicated, embedding=embedding,
                vocab=vocab, norm=norm)


def count_parameters(config: ModelConfig, tp: int = 1, *, padded: bool = True) -> int:
    """Parameters of the whole model (all tp ranks and stages together), counted analytically.

    The vocabulary is padded as at tensor-parallel size `tp` (`padded=False`: the real
    vocabulary). A tied output head adds nothing. Equals the sum of numel of the one-process
    model built at that padding.
    """
    parts = parameter_parts(config, tp, padded=padded)
    layer = parts["layer_sharded"] + parts["layer_replicated"]
    head = 0 if config.tie_word_embeddings else parts["vocab"]
    return config.num_layers * layer + parts["embedding"] + parts["norm"] + head


def full_name(name: str, param: torch.Tensor) -> str:
    """The parameter's name in the one-process model (a tied head copy maps to the embedding)."""
    return getattr(param, "tied_to", None) or name
