"""Shared pieces of the Hugging Face adapters: key-map rules, QKV (un)fusing, the adapter type.

A family adapter maps each megazoo full parameter (the one-process, unpadded tensor) to one or
more Hugging Face tensors through a `Rule`: `from_hf([hf tensors]) -> megazoo tensor` and
`to_hf(megazoo tensor) -> [hf tensors]`, exact inverses (copies, transposes, row
permutations: no arithmetic). Every conversion goes through this unsharded form; tensor and
pipeline splitting (and vocabulary padding) is the checkpoint writer's job.

megazoo's fused QKV at tp = 1 (see megazoo/layers/heads.py) is K kv groups of
`[q heads of the group (G d rows), k head (d), v head (d)]`; `fuse_qkv` / `split_qkv` convert
between it and separate q `[H d, ...]`, k, v `[K d, ...]` (rows along dim 0, weights and biases).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models import ModelConfig

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One megazoo parameter <-> its Hugging Face tensors (in `hf_keys` order)."""

    name: str
    hf_keys: tuple[str, ...]
    from_hf: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]


def copy_rule(name: str, key: str) -> Rule:
    """The same tensor under another name."""
    return Rule(name, (key,), lambda ts: ts[0], lambda t: [t])


def transpose_rule(name: str, key: str) -> Rule:
    """GPT-2's Conv1D stores weights as [in, out]; megazoo (nn.Linear) as [out, in]."""
    return Rule(name, (key,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             kv_heads: int) -> torch.Tensor:
    """q [H d, *], k, v [K d, *] -> megazoo fused [K (G + 2) d, *] (groups of [q.., k, v])."""
    rest = q.shape[1:]
    d = q.shape[0] // heads
    q = q.reshape(kv_heads, heads // kv_heads * d, *rest)  # [K, G d, *]
    k = k.reshape(kv_heads, d, *rest)  # [K, d, *]
    v = v.reshape(kv_heads, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [K (G + 2) d, *]


def split_qkv(fused: torch.Tensor, heads: int, kv_heads: int) -> Tensors:
    """Inverse of `fuse_qkv`: fused [K (G + 2) d, *] -> [q [H d, *], k [K d, *], v [K d, *]]."""
    rest = fused.shape[1:]
    group = heads // kv_heads
    d = fused.shape[0] // (kv_heads * (group + 2))
    blocks = fused.reshape(kv_heads, (group + 2) * d, *rest)  # [K, (G + 2) d, *]
    q, k, v = blocks.split([group * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


@dataclass(frozen=True)
class Adapter:
    """One Hugging Face architecture: config maps both ways and the key map.

    `prefix` is the base-model prefix ("transformer.", "model.") that checkpoints of the bare
    base model (e.g. the hub's gpt2) leave out; `ignored(key)` is true for HF keys that are
    not weights (buffers, a tied lm_head copy).
    """

    model_type: str
    family: str
    architecture: str
    prefix: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    rules: Callable[[ModelConfig], list[Rule]]
    ignored: Callable[[str], bool]


def hf_get(hf: dict, *names, default=None, required=True):
    """The first of `names` present in the HF config dict (ValueError if none and required)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if required and default is None:
        raise ValueError(f"HF config.json lacks {' / '.join(names)}")
    return default


def expect(condition: bool, message: str) -> None:
    """ValueError(message) unless condition: for configs megazoo cannot represent."""
    if not condition:
        raise ValueError(message)


def tied_head(cfg: ModelConfig, key: str, untied_name: str = "output_layer.weight") -> list[Rule]:
    """The lm_head rule when the embeddings are untied, nothing when tied."""
    return [] if cfg.tie_word_embeddings else [copy_rule(untied_name, key)]


def layer_rules(cfg: ModelConfig, per_layer: Callable[[str, str], list[Rule]],
                hf_layer: str) -> list[Rule]:
    """`per_layer(megazoo prefix, hf prefix)` for every layer i."""
    out = []
    for i in range(cfg.num_layers):
        out += per_layer(f"layers.{i}.", hf_layer.format(i=i))
    return out
