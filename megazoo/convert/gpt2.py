"""GPT-2 (`GPT2LMHeadModel`, model_type "gpt2") <-> megazoo "gpt".

Key map (HF -> megazoo), per layer i (`transformer.h.{i}.` -> `layers.{i}.`):
    transformer.wte.weight            -> embedding.word_embeddings.weight
    transformer.wpe.weight            -> embedding.position_embeddings
    ln_1.{weight,bias}                -> input_norm.{weight,bias}
    attn.c_attn.{weight,bias}         -> attention.qkv.{weight,bias}   Conv1D transpose, then
                                         [all q | all k | all v] -> per head [q, k, v]
    attn.c_proj.{weight,bias}         -> attention.dense.{weight,bias} (weight transposed)
    ln_2.{weight,bias}                -> post_attention_norm.{weight,bias}
    mlp.c_fc.{weight,bias}            -> mlp.fc1.{weight,bias}         (weight transposed)
    mlp.c_proj.{weight,bias}          -> mlp.fc2.{weight,bias}         (weight transposed)
    transformer.ln_f.{weight,bias}    -> final_norm.{weight,bias}
    lm_head.weight                    -> tied to wte (output_layer.weight if untied)
Dropout is not carried over (megazoo trains with its own dropout settings, default 0).
"""
from __future__ import annotations

import re

import torch

from ..models import ModelConfig
from .common import (Adapter, Rule, copy_rule, expect, fuse_qkv, hf_get, layer_rules, split_qkv,
                     tied_head, transpose_rule)

ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


def config_from_hf(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    expect(act in ACTIVATIONS, f"gpt2 activation_function {act!r} is not supported "
                               f"(supported: {sorted(ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        expect(not hf.get(flag, False), f"gpt2 with {flag}=true is not supported")
    expect(hf.get("scale_attn_weights", True), "gpt2 with scale_attn_weights=false is not supported")
    hidden = hf_get(hf, "n_embd", "hidden_size")
    return ModelConfig(
        family="gpt", num_layers=hf_get(hf, "n_layer", "num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=hf_get(hf, "n_head", "num_attention_heads"),
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden, vocab_size=hf_get(hf, "vocab_size"),
        max_position_embeddings=hf_get(hf, "n_positions", "max_position_embeddings"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=ACTIVATIONS[act],
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: ModelConfig) -> dict:
    expect(cfg.position_embedding == "learned" and cfg.norm == "layernorm"
           and cfg.activation in ("gelu", "gelu_exact") and not cfg.embedding_layernorm
           and cfg.qkv_bias and cfg.dense_bias and cfg.mlp_bias
           and cfg.num_key_value_heads == cfg.num_attention_heads,
           "this gpt config has no GPT-2 equivalent (GPT-2: learned positions, layernorm, gelu, "
           "all biases, no GQA)")
    return {"n_layer": cfg.num_layers, "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads,
            "n_inner": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new" if cfg.activation == "gelu" else "gelu",
            "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": cfg.init_std,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _c_attn(name: str, key: str, heads: int) -> Rule:
    """Conv1D [h, 3h] (or bias [3h]) = [all q | all k | all v] <-> fused per-head [q, k, v]."""
    def from_hf(ts):
        w = ts[0].t() if ts[0].dim() == 2 else ts[0]  # [3h, h] or [3h]
        return fuse_qkv(*w.chunk(3, dim=0), heads, heads)

    def to_hf(t):
        full = torch.cat(split_qkv(t, heads, heads), dim=0)  # [3h, *]
        return [full.t().contiguous() if full.dim() == 2 else full]
    return Rule(name, (key,), from_hf, to_hf)


def rules(cfg: ModelConfig) -> list[Rule]:
    heads = cfg.num_attention_heads

    def per_layer(m: str, h: str) -> list[Rule]:
        out = [copy_rule(m + "input_norm.weight", h + "ln_1.weight"),
               copy_rule(m + "input_norm.bias", h + "ln_1.bias"),
               _c_attn(m + "attention.qkv.weight", h + "attn.c_attn.weight", heads),
               _c_attn(m + "attention.qkv.bias", h + "attn.c_attn.bias", heads),
               transpose_rule(m + "attention.dense.weight", h + "attn.c_proj.weight"),
               copy_rule(m + "attention.dense.bias", h + "attn.c_proj.bias"),
               copy_rule(m + "post_attention_norm.weight", h + "ln_2.weight"),
               copy_rule(m + "post_attention_norm.bias", h + "ln_2.bias"),
               transpose_rule(m + "mlp.fc1.weight", h + "mlp.c_fc.weight"),
               copy_rule(m + "mlp.fc1.bias", h + "mlp.c_fc.bias"),
               transpose_rule(m + "mlp.fc2.weight", h + "mlp.c_proj.weight"),
               copy_rule(m + "mlp.fc2.bias", h + "mlp.c_proj.bias")]
        return out

    return ([copy_rule("embedding.word_embeddings.weight", "transformer.wte.weight"),
             copy_rule("embedding.position_embeddings", "transformer.wpe.weight")]
            + layer_rules(cfg, per_layer, "transformer.h.{i}.")
            + [copy_rule("final_norm.weight", "transformer.ln_f.weight"),
               copy_rule("final_norm.bias", "transformer.ln_f.bias")]
            + tied_head(cfg, "lm_head.weight"))


_BUFFERS = re.compile(r"\.attn\.(masked_)?bias$")
ADAPTER = Adapter("gpt2", "gpt", "GPT2LMHeadModel", "transformer.", config_from_hf, config_to_hf,
                  rules, lambda key: bool(_BUFFERS.search(key)) or key == "lm_head.weight")
