"""Tiny random Hugging Face models, the reference the converters and generation compare with:
GPT2LMHeadModel, BloomForCausalLM, LlamaForCausalLM (GQA: 4 heads, 2 kv heads); hidden 64,
2 layers, vocabulary 300 (not a multiple of 128, so padding is added and removed)."""
from __future__ import annotations

import pytest
import torch

VOCAB = 300


def hf():
    """`transformers`, imported lazily: spawned ranks import this module and need only torch."""
    return pytest.importorskip("transformers")


def hf_model(kind: str):
    """A tiny random HF model; every parameter perturbed so that no norm weight is 1 and no
    bias 0 (a misplaced bias or norm would otherwise go unnoticed)."""
    torch.manual_seed({"gpt2": 1, "bloom": 2, "llama": 3}[kind])
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    if kind == "gpt2":
        model = hf().GPT2LMHeadModel(hf().GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=32, **common))
    elif kind == "bloom":
        model = hf().BloomForCausalLM(hf().BloomConfig(
            hidden_size=64, n_layer=2, n_head=4, **common))
    else:
        model = hf().LlamaForCausalLM(hf().LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=32, rope_theta=5000.0, **common))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()
