"""`TransformerBlock`: the pre-norm decoder block shared by GPT, BLOOM and LLaMA.

    x = x + dropout(attention(norm_1(x)))
    x = x + dropout(mlp(norm_2(x)))

x, y: [s_local, b, h], s_local the rank's sequence shard (`parts.py`).

Every weight is initialised by a `NormalInit` keyed by its full parameter name
(`layers.{global index}.{path}`), so the block holds the same values, sliced, whatever the
tensor/pipeline layout. Output projections use the GPT-2 scaled std / sqrt(2 L).

Activation recompute (Korthikanti et al. 2022), set with `set_recompute`:
"full" reruns the whole block in backward (only its input is kept); "selective" reruns only
the parameter-free middle of the attention (RoPE, softmax(QK^T)V with its dropout, and with
Ulysses sp > 1 the two all-to-alls, which are then repeated in backward: ParallelAttention's
`recompute_core`). Both use non-reentrant `torch.utils.checkpoint`, which restores the RNG
state so dropout masks repeat.

`replay`, when set (`megazoo.training.block_graphs`), runs the block's training forward and
its backward as captured CUDA graphs; evaluation and generation run the block eagerly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config.model import ModelConfig
from ..layers import AttentionConfig, NormalInit, ParallelAttention, ParallelMLP
from ..layers.norm import build_norm
from ..parallel.state import ParallelState


class TransformerBlock(nn.Module):
    """One decoder block; `layer_number` is its global index (0-based) in the whole model."""

    def __init__(self, config: ModelConfig, state: ParallelState, layer_number: int, *,
                 seed: int = 0, device=None, dtype=None):
        super().__init__()
        self.layer_number, self.hidden_dropout = layer_number, config.hidden_dropout
        self.recompute = "none"
        self.replay = None  # x -> y through captured CUDA graphs, training only
        megatron_sp = state.config.megatron_sp
        std = config.init_std
        out_std = std / math.sqrt(2 * config.num_layers) if config.scaled_output_init else std
        prefix = f"layers.{layer_number}."

        def init(name: str, s: float) -> NormalInit:
            return NormalInit(std=s, seed=seed, key=prefix + name)

        norm = dict(sequence_parallel=megatron_sp, device=device, dtype=dtype)
        self.input_norm = build_norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        self.attention = ParallelAttention(
            attention_config(config), tp_group=state.tp, sp_group=state.sp, megatron_sp=megatron_sp,
            init_method=init("attention.qkv.weight", std),
            output_init_method=init("attention.dense.weight", out_std), device=device, dtype=dtype,
            fp8=config.fp8("attention"), cp_group=state.cp)
        self.post_attention_norm = build_norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        self.mlp = ParallelMLP(
            config.hidden_size, config.ffn_hidden_size, group=state.tp,
            activation=config.activation, bias=config.mlp_bias, sequence_parallel=megatron_sp,
            init_method=init("mlp.fc1.weight", std), output_init_method=init("mlp.fc2.weight", out_std),
            device=device, dtype=dtype, fp8=config.fp8("mlp"),
            bias_gelu_fusion=config.bias_gelu_fusion)

    def set_recompute(self, mode: str) -> None:
        """"none", "full" or "selective" (see the module docstring)."""
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"recompute must be none, full or selective, got {mode!r}")
        self.recompute = mode
        self.attention.recompute_core = mode == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, h] -> y [s_local, b, h]."""
        if self.replay is not None and self.training and torch.is_grad_enabled():
            return self.replay(x)
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.input_norm(x))
        x = x + F.dropout(a, self.hidden_dropout, self.training)
        m = self.mlp(self.post_attention_norm(x))
        return x + F.dropout(m, self.hidden_dropout, self.training)


def attention_config(config: ModelConfig) -> AttentionConfig:
    """The attention of a block of `config`. Learned positions are added to the embedding, so
    attention then sees no positions."""
    positions = "none" if config.position_embedding == "learned" else config.position_embedding
    return AttentionConfig(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, position_embedding=positions,
        rope_theta=config.rope_theta, qkv_bias=config.qkv_bias, dense_bias=config.dense_bias,
        attention_dropout=config.attention_dropout, attention_backend=config.attention_backend,
        sparse=config.sparse)
