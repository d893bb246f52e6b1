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

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..checkpoint.layout import full_shapes
from ..models import ModelConfig

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One megazoo parameter <-> its Hugging Face tensors (in `hf_keys` order)."""

    name: str
    hf_keys: tuple[str, ...]
    from_hf: Callable[[Tensors], torch.Tensor]
    to_hf: Callable[[torch.Tensor], Tensors]


def copy_rule(cfg: ModelConfig, name: str, keys: tuple[str]) -> Rule:
    """The same tensor under another name."""
    return Rule(name, keys, lambda ts: ts[0], lambda t: [t])


def transpose_rule(cfg: ModelConfig, name: str, keys: tuple[str]) -> Rule:
    """GPT-2's Conv1D stores weights as [in, out]; megazoo (nn.Linear) as [out, in] (a bias,
    1-D, stays as it is)."""
    return Rule(name, keys, lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


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


#: A rule maker: (config, megazoo name, HF keys) -> Rule.
RuleMaker = Callable[[ModelConfig, str, tuple[str, ...]], Rule]


@dataclass(frozen=True)
class Adapter:
    """One Hugging Face architecture: config maps both ways and the key map.

    `key_map` maps each megazoo module (`layers.{i}.` for every layer) to its HF module, or to
    the HF modules one megazoo tensor fuses; `.weight` / `.bias` carry over, and a parameter
    that is neither maps to a whole HF key. `makers` names the modules whose tensors are not
    copied unchanged (`copy_rule`). `prefix` is the base-model prefix ("transformer.",
    "model.") that checkpoints of the bare base model (e.g. the hub's gpt2) leave out;
    `ignored(key)` is true for HF keys that are not weights (buffers, a tied lm_head copy).
    """

    model_type: str
    family: str
    architecture: str
    prefix: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    key_map: dict[str, str | tuple[str, ...]]
    makers: dict[str, RuleMaker]
    ignored: Callable[[str], bool]

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        """One Rule per stored parameter of `cfg`'s model, in the model's order."""
        out = []
        for name in full_shapes(cfg):
            index, module, suffix = re.fullmatch(r"(?:layers\.(\d+)\.)?(.*?)(\.weight|\.bias)?",
                                                 name).groups()
            pattern = module if index is None else "layers.{i}." + module
            if pattern not in self.key_map:
                raise AssertionError(f"the {self.model_type} key map has no entry for {name}")
            hf = self.key_map[pattern]
            keys = tuple(m.format(i=index) + (suffix or "")
                         for m in (hf if isinstance(hf, tuple) else (hf,)))
            out.append(self.makers.get(pattern, copy_rule)(cfg, name, keys))
        return out


def hf_get(hf: dict, *names):
    """The first of `names` present in the HF config dict (ValueError if none is)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    raise ValueError(f"HF config.json lacks {' / '.join(names)}")


def expect(condition: bool, message: str) -> None:
    """ValueError(message) unless condition: for configs megazoo cannot represent."""
    if not condition:
        raise ValueError(message)
