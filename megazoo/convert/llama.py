"""LLaMA (`LlamaForCausalLM`, model_type "llama") <-> megazoo "llama".

Key map (HF -> megazoo), per layer i (`model.layers.{i}.` -> `layers.{i}.`):
    model.embed_tokens.weight                   -> embedding.word_embeddings.weight
    input_layernorm.weight                      -> input_norm.weight
    self_attn.{q,k,v}_proj.{weight,bias}        -> attention.qkv.*  (fused: K groups of
                                                   [G q heads, k head, v head], GQA-aware)
    self_attn.o_proj.*                          -> attention.dense.*
    post_attention_layernorm.weight             -> post_attention_norm.weight
    mlp.gate_proj / mlp.up_proj                 -> mlp.fc1 ([gate; up] fused SwiGLU)
    mlp.down_proj                               -> mlp.fc2
    model.norm.weight                           -> final_norm.weight
    lm_head.weight                              -> output_layer.weight (untied)
Rotary convention: HF's q_proj / k_proj rows are already in the rotate_half (halves) order
that megazoo's RoPE uses (megazoo/layers/positions.py), so no row permutation is needed
(the permutation in HF's own conversion script maps Meta's interleaved pairs to halves).
"""
from __future__ import annotations

import torch

from ..models import ModelConfig
from .common import Adapter, Rule, copy_rule, expect, fuse_qkv, hf_get, layer_rules, split_qkv, tied_head


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


def _qkv(name: str, keys: tuple[str, ...], heads: int, kv_heads: int) -> Rule:
    return Rule(name, keys, lambda ts: fuse_qkv(*ts, heads, kv_heads),
                lambda t: split_qkv(t, heads, kv_heads))


def _swiglu(name: str, keys: tuple[str, str]) -> Rule:
    """[gate; up] stacked along the output rows; megazoo's fused fc1 is the same stack."""
    return Rule(name, keys, lambda ts: torch.cat(ts, dim=0),
                lambda t: [c.contiguous() for c in t.chunk(2, dim=0)])


def rules(cfg: ModelConfig) -> list[Rule]:
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def per_layer(m: str, h: str) -> list[Rule]:
        attn = h + "self_attn."
        suffixes = (".weight", ".bias") if cfg.qkv_bias else (".weight",)
        out = [copy_rule(m + "input_norm.weight", h + "input_layernorm.weight")]
        for s in suffixes:
            out.append(_qkv(m + "attention.qkv" + s, tuple(attn + p + s for p in
                                                          ("q_proj", "k_proj", "v_proj")), heads, kv))
            out.append(copy_rule(m + "attention.dense" + s, attn + "o_proj" + s))
        out.append(copy_rule(m + "post_attention_norm.weight", h + "post_attention_layernorm.weight"))
        for s in (".weight", ".bias") if cfg.mlp_bias else (".weight",):
            out.append(_swiglu(m + "mlp.fc1" + s, (h + "mlp.gate_proj" + s, h + "mlp.up_proj" + s)))
            out.append(copy_rule(m + "mlp.fc2" + s, h + "mlp.down_proj" + s))
        return out

    return ([copy_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
            + layer_rules(cfg, per_layer, "model.layers.{i}.")
            + [copy_rule("final_norm.weight", "model.norm.weight")]
            + tied_head(cfg, "lm_head.weight"))


ADAPTER = Adapter("llama", "llama", "LlamaForCausalLM", "model.", config_from_hf, config_to_hf,
                  rules, lambda key: key.endswith("rotary_emb.inv_freq") or key == "lm_head.weight")
