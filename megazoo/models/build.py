"""`build_model`: a preset name or a ModelConfig -> this rank's model (or pipeline stage)."""
from __future__ import annotations

import copy

import torch

from ..layers.groups import divide
from ..layers.heads import HeadLayout
from ..layers.ulysses import check_sequence_split
from ..parallel.config import ParallelConfig
from ..parallel.state import ParallelState
from .bloom import BloomModel
from ..config.model import ModelConfig
from .gpt import GPTModel
from .llama import LlamaModel
from .model import TransformerModel
from ..config.presets import PRESETS

MODEL_CLASSES = {"gpt": GPTModel, "bloom": BloomModel, "llama": LlamaModel}


def resolve_config(model: str | ModelConfig) -> ModelConfig:
    """A copy of the preset named `model`, or `model` itself."""
    if isinstance(model, ModelConfig):
        return model
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[model])


def layer_ranges(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[range]:
    """The layers of pipeline rank `pp_rank`: chunk c holds block c*pp + pp_rank of the
    model cut into pp*vpp equal blocks (Megatron's interleaved assignment)."""
    blocks = pp * vpp
    if num_layers % blocks:
        raise ValueError(f"num_layers {num_layers} must divide by pp*vpp = {blocks} "
                         f"(pp={pp}, vpp={vpp}): change the layout or the model")
    per = num_layers // blocks
    return [range((c * pp + pp_rank) * per, (c * pp + pp_rank + 1) * per) for c in range(vpp)]


def check_layout(config: ModelConfig, parallel: ParallelConfig,
                 seq_length: int | None = None) -> None:
    """Raise a ValueError (no collective) unless `config` can be laid out as `parallel`.

    The one check of a model against a layout, shared by `build_model`, the training run
    (at argument parsing) and the memory planner: attention heads and kv heads over tp x sp,
    the MLP width over tp, layers over pp x vpp, the padded vocabulary over tp, and, given a
    `seq_length`, the sequence over the shards of Ulysses / Megatron SP and the learned
    position table.
    """
    HeadLayout(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
               parallel.tp, parallel.sp)
    divide(config.ffn_hidden_size, parallel.tp, f"ffn_hidden_size over tp={parallel.tp}")
    layer_ranges(config.num_layers, parallel.pp, parallel.vpp, 0)
    config.padded_vocab(parallel.tp)
    if seq_length is None:
        return
    check_sequence_split(seq_length, parallel.tp, parallel.sp, parallel.megatron_sp)
    if config.position_embedding == "learned" and seq_length > config.max_position_embeddings:
        raise ValueError(f"--seq-length {seq_length} exceeds --max-position-embeddings "
                         f"{config.max_position_embeddings}")


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
