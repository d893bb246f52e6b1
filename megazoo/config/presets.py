"""`PRESETS`: the published shapes, as `ModelConfig`s.

GPT: the GPT-3 paper's table (Brown et al. 2020), 2048 tokens, the GPT-2 vocabulary of
50,257. Two rows use Megatron's usual corrections of the paper: 1.3B with 16 heads (the
paper's 24 heads do not divide 2048) and 13B with h = 5120 (5140 does not divide by 40).
gpt3-175b pads its vocabulary to 51,200 at any tp (50,257 rounded up to a multiple of
128 x 8, Megatron's padding at the paper's tp = 8), which gives the 174,615,846,912
parameters usually quoted for it; the other GPT presets use Megatron's rule (50,304 at tp=1).
Parameters: L (12 h^2 + 13 h) + (V + 2048) h + 2 h (tied head).

BLOOM: the Hugging Face bigscience/bloom* configs (vocab 250,880, which every tp up to 8
divides at the 128 multiple). bloom-176b: L (12 h^2 + 13 h) + V h + 4 h (embedding and final
LayerNorms) = 176,247,271,424 with L=70, h=14336.

LLaMA: LLaMA-2 shapes (4096 positions, RMSNorm eps 1e-5, vocab 32,000, untied head);
llama-70b uses 8 key/value heads and ffn 28,672.
"""
from __future__ import annotations

from .model import ModelConfig


def _gpt(layers: int, hidden: int, heads: int, **extra) -> ModelConfig:
    return ModelConfig(family="gpt", num_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, vocab_size=50257,
                       max_position_embeddings=2048, **extra)


def _bloom(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(family="bloom", num_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, vocab_size=250880,
                       max_position_embeddings=2048)


def _llama(layers: int, hidden: int, heads: int, ffn: int, kv_heads: int | None = None) -> ModelConfig:
    return ModelConfig(family="llama", num_layers=layers, hidden_size=hidden,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       ffn_hidden_size=ffn, vocab_size=32000, max_position_embeddings=4096)


PRESETS: dict[str, ModelConfig] = {
    "gpt-125m": _gpt(12, 768, 12),
    "gpt-350m": _gpt(24, 1024, 16),
    "gpt-760m": _gpt(24, 1536, 16),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-2.7b": _gpt(32, 2560, 32),
    "gpt-6.7b": _gpt(32, 4096, 32),
    "gpt-13b": _gpt(40, 5120, 40),
    "gpt3-175b": _gpt(96, 12288, 96, padded_vocab_size=51200),
    "bloom-560m": _bloom(24, 1024, 16),
    "bloom-1b1": _bloom(24, 1536, 16),
    "bloom-1b7": _bloom(24, 2048, 16),
    "bloom-3b": _bloom(30, 2560, 32),
    "bloom-7b1": _bloom(30, 4096, 32),
    "bloom-176b": _bloom(70, 14336, 112),
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
}
"""Name -> ModelConfig. Copy before changing one (`dataclasses.replace(PRESETS[n], ...)`)."""
