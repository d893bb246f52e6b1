"""Hugging Face checkpoint files, lazily: read tensor by tensor, write shard by shard.

Reading: `model.safetensors` or `model.safetensors.index.json` (+ its shards). Only headers
are parsed up front (names, shapes); each tensor is read when asked, with the file opened for
that read only, so the memory map never keeps the whole model resident. `pytorch_model.bin`
is refused: megazoo reads nothing with pickle.

Writing: tensors go into `model-0000i-of-0000n.safetensors` files of at most
`max_shard_bytes` (one `model.safetensors` when it fits), planned from shapes before any data
exists and streamed with `SafetensorsWriter`; an index json maps keys to files when sharded.
"""
from __future__ import annotations

import math
import os
from typing import Iterable

import torch
from safetensors import safe_open

from ..checkpoint.files import SafetensorsWriter, write_json
from ..errors import read_json

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def read_hf_config(hf_dir: str) -> dict:
    file = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    return read_json(file, advice="fix it or convert another --hf-dir")


class HFReader:
    """Names, shapes and (lazily) tensors of a Hugging Face safetensors checkpoint."""

    def __init__(self, hf_dir: str, prefix: str = ""):
        self.dir = hf_dir
        files = self._files()
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = os.path.join(hf_dir, name)
            if not os.path.isfile(path):
                raise ValueError(f"HF shard {path} is missing")
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        self.file_of[key] = path
                        self.shapes[key] = tuple(f.get_slice(key).get_shape())
            except Exception as exc:  # safetensors' own error types
                raise ValueError(f"HF shard {path} is damaged or truncated ({exc})") from None
        self.alias = {}
        if prefix and not any(k.startswith(prefix) for k in self.file_of):
            # a bare base model (the hub's gpt2): keys lack the "transformer." prefix
            self.alias = {prefix + k: k for k in self.file_of if not k.startswith("lm_head.")}
        aliased = set(self.alias.values())
        self.keys = set(self.alias) | {k for k in self.file_of if k not in aliased}

    def _files(self) -> list[str]:
        index = os.path.join(self.dir, INDEX)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map: fix it or convert another --hf-dir")
            return sorted(set(weight_map.values()))
        if os.path.isfile(os.path.join(self.dir, SINGLE)):
            return [SINGLE]
        if any(n.endswith(".bin") for n in os.listdir(self.dir)):
            raise ValueError(f"{self.dir} holds only pickle (.bin) weights: re-save them as "
                             f"safetensors (save_pretrained(..., safe_serialization=True))")
        raise ValueError(f"HF weights are missing: {self.dir} has no {SINGLE} nor {INDEX}")

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[self.alias.get(key, key)]

    def get(self, key: str) -> torch.Tensor:
        real = self.alias.get(key, key)
        file = self.file_of[real]
        try:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(real)
        except Exception as exc:
            raise ValueError(f"HF shard {file}: cannot read {real!r} ({exc})") from None


def plan_shards(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                max_shard_bytes: int) -> list[list[str]]:
    """Consecutive keys grouped into files of at most max_shard_bytes (a bigger tensor alone)."""
    groups, size = [[]], 0
    for key, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def write_hf_weights(out_dir: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     tensors: Iterable[tuple[str, torch.Tensor]],
                     max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `tensors` ((key, tensor) pairs in `specs` order) into HF-style safetensors shards
    planned by `plan_shards`, plus the index json when there are several."""
    groups = plan_shards(specs, max_shard_bytes)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    tensors = iter(tensors)
    for name, group in zip(names, groups):
        with SafetensorsWriter(os.path.join(out_dir, name), {k: specs[k] for k in group}) as w:
            for _ in group:
                w.write(*next(tensors))
    if n > 1:
        total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
        write_json(os.path.join(out_dir, INDEX), {
            "metadata": {"total_size": total},
            "weight_map": {k: name for name, group in zip(names, groups) for k in group}})
