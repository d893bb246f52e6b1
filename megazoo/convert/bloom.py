"""BLOOM (`BloomForCausalLM`, model_type "bloom") <-> megazoo "bloom".

`KEY_MAP` is the key map. BLOOM's `query_key_value` is stored per head as [q, k, v] (a view
of [heads, 3, d, h]), which is exactly megazoo's fused QKV layout at tp = 1 for multi-head
attention, so every tensor is copied unchanged. ALiBi needs no position table: megazoo's
max_position_embeddings is taken from HF's `seq_length` when present, else 2048 (it only
bounds the sequence length).
"""
from __future__ import annotations

from ..models import ModelConfig
from .common import Adapter, expect, hf_get


def config_from_hf(hf: dict) -> ModelConfig:
    expect(not hf.get("apply_residual_connection_post_layernorm", False),
           "bloom with apply_residual_connection_post_layernorm=true is not supported")
    hidden = hf_get(hf, "hidden_size", "n_embed")
    return ModelConfig(
        family="bloom", num_layers=hf_get(hf, "n_layer", "num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=hf_get(hf, "n_head", "num_attention_heads"), ffn_hidden_size=4 * hidden,
        vocab_size=hf_get(hf, "vocab_size"), max_position_embeddings=hf.get("seq_length") or 2048,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig) -> dict:
    expect(cfg.position_embedding == "alibi" and cfg.norm == "layernorm" and cfg.activation == "gelu"
           and cfg.embedding_layernorm and cfg.qkv_bias and cfg.dense_bias and cfg.mlp_bias
           and cfg.num_key_value_heads == cfg.num_attention_heads
           and cfg.ffn_hidden_size == 4 * cfg.hidden_size,
           "this bloom config has no HF BLOOM equivalent (ALiBi, layernorm, gelu, 4h MLP, biases, MHA)")
    return {"n_layer": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "n_head": cfg.num_attention_heads, "vocab_size": cfg.vocab_size,
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "initializer_range": cfg.init_std, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "apply_residual_connection_post_layernorm": False, "pretraining_tp": 1,
            "slow_but_exact": False, "seq_length": cfg.max_position_embeddings}


KEY_MAP = {
    "embedding.word_embeddings": "transformer.word_embeddings",
    "embedding.norm": "transformer.word_embeddings_layernorm",
    "layers.{i}.input_norm": "transformer.h.{i}.input_layernorm",
    "layers.{i}.attention.qkv": "transformer.h.{i}.self_attention.query_key_value",
    "layers.{i}.attention.dense": "transformer.h.{i}.self_attention.dense",
    "layers.{i}.post_attention_norm": "transformer.h.{i}.post_attention_layernorm",
    "layers.{i}.mlp.fc1": "transformer.h.{i}.mlp.dense_h_to_4h",
    "layers.{i}.mlp.fc2": "transformer.h.{i}.mlp.dense_4h_to_h",
    "final_norm": "transformer.ln_f",
    "output_layer": "lm_head",  # only when untied; tied, lm_head is the embedding copy
}
ADAPTER = Adapter("bloom", "bloom", "BloomForCausalLM", "transformer.", config_from_hf,
                  config_to_hf, KEY_MAP, {}, lambda key: key == "lm_head.weight")
