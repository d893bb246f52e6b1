"""`build_model`: a preset name or a ModelConfig -> this rank's model (or pipeline stage)."""
from __future__ import annotations

import copy

import torch

from ..config.layout import check_layout, layer_ranges
from ..config.model import ModelConfig
from ..config.presets import PRESETS
from ..parallel.state import ParallelState
from .model import BloomModel, GPTModel, LlamaModel, TransformerModel

MODEL_CLASSES = {"gpt": GPTModel, "bloom": BloomModel, "llama": LlamaModel}


def resolve_config(model: str | ModelConfig) -> ModelConfig:
    """A copy of the preset named `model`, or `model` itself."""
    if isinstance(model, ModelConfig):
        return model
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[model])


def build_model(model: str | ModelConfig, state: ParallelState | None = None, device="meta",
                seed: int = 0, dtype: torch.dtype | None = None) -> TransformerModel:
    """Build this rank's part of the model: tp/sp shards, and its pipeline stage when pp > 1.

    `device="meta"` allocates nothing (any preset builds in seconds, to count or plan).
    The same seed gives the same weights, sliced, in every layout.
    """
    config = resolve_config(model)
    state = state or ParallelState.single()
    cfg = state.config
    check_layout(config, cfg)
    layers = layer_ranges(config.num_layers, cfg.pp, cfg.vpp, state.pp.rank)
    return MODEL_CLASSES[config.family](
        config, state, layers=layers if cfg.vpp > 1 else layers[0],
        pre_process=state.is_first_stage, post_process=state.is_last_stage,
        seed=seed, device=device, dtype=dtype)
