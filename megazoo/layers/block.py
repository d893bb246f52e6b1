"""`TransformerBlock`: the pre-norm decoder block shared by GPT, BLOOM and LLaMA.

    x = x + dropout(attention(norm_1(x)))
    x = x + dropout(mlp(norm_2(x)))

x, y: [s_local, b, h], where s_local is the rank's sequence shard: s / sp with Ulysses, and a
further / tp with Megatron sequence parallelism (sp shard outermost, tp shard inside it).

Every weight is initialised by a `NormalInit` keyed by its full parameter name
(`layers.{global index}.{path}`), so the block holds the same values, sliced, whatever the
tensor/pipeline layout. Output projections use the GPT-2 scaled std / sqrt(2 L).

Activation recompute (Korthikanti et al. 2022), set with `set_recompute`:
"full" reruns the whole block in backward (only its input is kept); "selective" reruns only
the parameter-free middle of the attention (RoPE, softmax(QK^T)V with its dropout, and with
Ulysses sp > 1 the two all-to-alls, which are then repeated in backward). Both use non-reentrant
`torch.utils.checkpoint`, which restores the RNG state so dropout masks repeat.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..parallel.state import ParallelState
from .init import NormalInit
from .mlp import ParallelMLP
from .norm import build_norm
from .parallel_attention import ParallelAttention
from .sharding import set_tp_layout

if TYPE_CHECKING:
    from ..models.config import ModelConfig


class _Recomputed(nn.Module):
    """Runs `module` under non-reentrant activation checkpointing while `enabled`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module, self.enabled = module, False

    def forward(self, *args, **kwargs):
        if self.enabled and torch.is_grad_enabled():
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)
        return self.module(*args, **kwargs)


class TransformerBlock(nn.Module):
    """One decoder block; `layer_number` is its global index (0-based) in the whole model."""

    def __init__(self, config: "ModelConfig", state: ParallelState, layer_number: int, *,
                 seed: int = 0, device=None, dtype=None):
        super().__init__()
        self.layer_number, self.hidden_dropout = layer_number, config.hidden_dropout
        self.recompute = "none"
        sp_on = state.config.sequence_parallel
        std = config.init_std
        out_std = std / math.sqrt(2 * config.num_layers) if config.scaled_output_init else std
        prefix = f"layers.{layer_number}."

        def init(name: str, s: float) -> NormalInit:
            return NormalInit(std=s, seed=seed, key=prefix + name)

        norm = dict(sequence_parallel=sp_on, device=device, dtype=dtype)
        self.input_norm = build_norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        self.attention = ParallelAttention(
            config.hidden_size, config.num_attention_heads, tp_group=state.tp, sp_group=state.sp,
            num_kv_heads=config.num_key_value_heads, position_embedding=_attention_positions(config),
            rope_theta=config.rope_theta, bias=config.qkv_bias,
            attention_dropout=config.attention_dropout, sequence_parallel=sp_on,
            init_method=init("attention.qkv.weight", std),
            output_init_method=init("attention.dense.weight", out_std),
            attention_backend=config.attention_backend, device=device, dtype=dtype)
        _drop_dense_bias(self.attention, config.dense_bias)
        self.post_attention_norm = build_norm(config.norm, config.hidden_size, config.norm_eps, **norm)
        self.mlp = ParallelMLP(
            config.hidden_size, config.ffn_hidden_size, group=state.tp,
            activation=config.activation, bias=config.mlp_bias, sequence_parallel=sp_on,
            init_method=init("mlp.fc1.weight", std), output_init_method=init("mlp.fc2.weight", out_std),
            device=device, dtype=dtype)
        _annotate_qkv(self.attention)
        # Selective recompute wraps the parameter-free middle of ParallelAttention: RoPE, the
        # Ulysses all-to-alls (no-ops at sp = 1) and the core softmax(QK^T)V.
        self.attention.attention = _Recomputed(self.attention.attention)

    def set_recompute(self, mode: str) -> None:
        """"none", "full" or "selective" (see the module docstring)."""
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"recompute must be none, full or selective, got {mode!r}")
        self.recompute = mode
        self.attention.attention.enabled = mode == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, h] -> y [s_local, b, h]."""
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(self.input_norm(x))
        x = x + F.dropout(a, self.hidden_dropout, self.training)
        m = self.mlp(self.post_attention_norm(x))
        return x + F.dropout(m, self.hidden_dropout, self.training)


def _annotate_qkv(attention: ParallelAttention) -> None:
    """The fused QKV rows a tp rank holds are listed by the attention's head layout."""
    layout = attention.layout
    for p in attention.qkv.parameters():
        set_tp_layout(p, 0, index=layout.qkv_rows, full_size=layout.qkv_rows_full)


def _attention_positions(config: "ModelConfig") -> str:
    """Learned positions are added to the embedding; attention then sees no positions."""
    return "none" if config.position_embedding == "learned" else config.position_embedding


def _drop_dense_bias(attention: nn.Module, keep: bool) -> None:
    """ParallelAttention takes one `bias` flag (given qkv_bias); drop the output projection's
    bias when the config asks for a QKV bias without a dense bias."""
    dense = getattr(attention, "dense", None)
    if keep or dense is None or getattr(dense, "bias", None) is None:
        if keep and dense is not None and getattr(dense, "bias", None) is None:
            raise ValueError("dense_bias=True needs qkv_bias=True: ParallelAttention has one "
                             "bias flag; set both or neither")
        return
    dense.bias = None
