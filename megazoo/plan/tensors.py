"""The parameter tensors of a model as the engines lay them out: (elements per tp rank, is a
matrix) in the model's order, read from a one-block model built on the meta device (cached
per shape), for the planner's models of DeepSpeed's sub-groups and the plain engine's
buckets, whose pinned buffers round up to powers of two one by one."""
from __future__ import annotations

import dataclasses

from ..config.model import ModelConfig

_CACHE: dict[tuple, tuple] = {}  # (repr(one-block config), tp) -> (embedding, block, head)


def model_tensors(config: ModelConfig, tp: int, layers: int | None = None,
                  first: bool = True, last: bool = True) -> list[tuple[int, bool]]:
    """(elements per tp rank, ndim >= 2) of every parameter of `layers` blocks (all: None),
    with the embedding's (`first`) and the final norm's and head's (`last`), in order."""
    key = (repr(dataclasses.replace(config, num_layers=1)), tp)
    if key not in _CACHE:
        _CACHE[key] = _one_block(config, tp)
    embed, block, head = _CACHE[key]
    count = config.num_layers if layers is None else layers
    return (embed if first else []) + block * count + (head if last else [])


def _one_block(config: ModelConfig, tp: int) -> tuple[list, list, list]:
    from ..models.build import build_model

    model = build_model(dataclasses.replace(config, num_layers=1), device="meta")
    embed, block, head = [], [], []
    for name, p in model.named_parameters():
        numel = p.numel() // tp if getattr(p, "tp_dim", None) is not None else p.numel()
        part = block if name.startswith("layers.") else embed if not block else head
        part.append((numel, p.ndim >= 2))
    return embed, block, head
