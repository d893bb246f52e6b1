"""GPT-2 (`GPT2LMHeadModel`, model_type "gpt2") <-> megazoo "gpt".

`KEY_MAP` is the key map. GPT-2's Conv1D stores linear weights transposed ([in, out]), and
its `c_attn` holds [all q | all k | all v] where megazoo fuses [q, k, v] per head. Dropout is
not carried over (megazoo trains with its own dropout settings, default 0).
"""
from __future__ import annotations

import re

import torch

from ..models import ModelConfig
from .common import Adapter, Rule, expect, fuse_qkv, hf_get, split_qkv, transpose_rule

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


def _c_attn(cfg: ModelConfig, name: str, keys: tuple[str]) -> Rule:
    """Conv1D [h, 3h] (or bias [3h]) = [all q | all k | all v] <-> fused per-head [q, k, v]."""
    heads = cfg.num_attention_heads

    def from_hf(ts):
        w = ts[0].t() if ts[0].dim() == 2 else ts[0]  # [3h, h] or [3h]
        return fuse_qkv(*w.chunk(3, dim=0), heads, heads)

    def to_hf(t):
        full = torch.cat(split_qkv(t, heads, heads), dim=0)  # [3h, *]
        return [full.t().contiguous() if full.dim() == 2 else full]
    return Rule(name, keys, from_hf, to_hf)


KEY_MAP = {
    "embedding.word_embeddings": "transformer.wte",
    "embedding.position_embeddings": "transformer.wpe.weight",
    "layers.{i}.input_norm": "transformer.h.{i}.ln_1",
    "layers.{i}.attention.qkv": "transformer.h.{i}.attn.c_attn",
    "layers.{i}.attention.dense": "transformer.h.{i}.attn.c_proj",
    "layers.{i}.post_attention_norm": "transformer.h.{i}.ln_2",
    "layers.{i}.mlp.fc1": "transformer.h.{i}.mlp.c_fc",
    "layers.{i}.mlp.fc2": "transformer.h.{i}.mlp.c_proj",
    "final_norm": "transformer.ln_f",
    "output_layer": "lm_head",  # only when untied; tied, lm_head is the wte copy
}
MAKERS = {"layers.{i}.attention.qkv": _c_attn, "layers.{i}.attention.dense": transpose_rule,
          "layers.{i}.mlp.fc1": transpose_rule, "layers.{i}.mlp.fc2": transpose_rule}
_BUFFERS = re.compile(r"\.attn\.(masked_)?bias$")
ADAPTER = Adapter("gpt2", "gpt", "GPT2LMHeadModel", "transformer.", config_from_hf, config_to_hf,
                  KEY_MAP, MAKERS,
                  lambda key: bool(_BUFFERS.search(key)) or key == "lm_head.weight")
