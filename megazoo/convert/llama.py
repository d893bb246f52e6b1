"""LLaMA (`LlamaForCausalLM`, model_type "llama") <-> megazoo "llama".

`KEY_MAP` is the key map: q/k/v projections fuse into megazoo's QKV (K groups of [G q heads,
k head, v head], GQA-aware), gate/up into the SwiGLU fc1 ([gate; up]).
Rotary convention: HF's q_proj / k_proj rows are already in the rotate_half (halves) order
that megazoo's RoPE uses (megazoo/layers/positions.py), so no row permutation is needed
(the permutation in HF's own conversion script maps Meta's interleaved pairs to halves).
"""
from __future__ import annotations

import torch

from ..models import ModelConfig
from .common import Adapter, Rule, expect, fuse_qkv, hf_get, split_qkv


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    expect(kind == "default", f"llama rope type {kind!r} is not supported (only the default RoPE)")
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def config_from_hf(hf: dict) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    expect(act == "silu", f"llama hidden_act {act!r} is not supported (silu only)")
    hidden, heads = hf_get(hf, "hidden_size"), hf_get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or hidden // heads
    expect(head_dim * heads == hidden, f"llama head_dim {head_dim} x {heads} heads != hidden "
                                       f"{hidden} is not supported")
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        family="llama", num_layers=hf_get(hf, "num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf_get(hf, "intermediate_size"), vocab_size=hf_get(hf, "vocab_size"),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), qkv_bias=bias, dense_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)), init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig) -> dict:
    expect(cfg.position_embedding == "rope" and cfg.norm == "rmsnorm" and cfg.activation == "swiglu"
           and not cfg.embedding_layernorm and cfg.qkv_bias == cfg.dense_bias,
           "this llama config has no HF LLaMA equivalent (RoPE, rmsnorm, swiglu, one attention bias flag)")
    return {"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
            "initializer_range": cfg.init_std, "attention_dropout": 0.0}


def _qkv(cfg: ModelConfig, name: str, keys: tuple[str, str, str]) -> Rule:
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    return Rule(name, keys, lambda ts: fuse_qkv(*ts, heads, kv_heads),
                lambda t: split_qkv(t, heads, kv_heads))


def _swiglu(cfg: ModelConfig, name: str, keys: tuple[str, str]) -> Rule:
    """[gate; up] stacked along the output rows; megazoo's fused fc1 is the same stack."""
    return Rule(name, keys, lambda ts: torch.cat(ts, dim=0),
                lambda t: [c.contiguous() for c in t.chunk(2, dim=0)])


KEY_MAP = {
    "embedding.word_embeddings": "model.embed_tokens",
    "layers.{i}.input_norm": "model.layers.{i}.input_layernorm",
    "layers.{i}.attention.qkv": ("model.layers.{i}.self_attn.q_proj",
                                 "model.layers.{i}.self_attn.k_proj",
                                 "model.layers.{i}.self_attn.v_proj"),
    "layers.{i}.attention.dense": "model.layers.{i}.self_attn.o_proj",
    "layers.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
    "layers.{i}.mlp.fc1": ("model.layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.up_proj"),
    "layers.{i}.mlp.fc2": "model.layers.{i}.mlp.down_proj",
    "final_norm": "model.norm",
    "output_layer": "lm_head",
}
ADAPTER = Adapter("llama", "llama", "LlamaForCausalLM", "model.", config_from_hf, config_to_hf,
                  KEY_MAP, {"layers.{i}.attention.qkv": _qkv, "layers.{i}.mlp.fc1": _swiglu},
                  lambda key: key.endswith("rotary_emb.inv_freq") or key == "lm_head.weight")
