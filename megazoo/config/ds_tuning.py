"""The ZeRO-3 settings a DeepSpeed user tunes, scaled to the model (`zero3_settings`).

DeepSpeed's own defaults are sized for no model in particular: 5e8-element reduce buckets,
a 5e7-element prefetch, parameters under 1e5 elements kept whole. What a user sets for a
GPU run, and what `build_ds_config` fills in where the JSON says nothing (or "auto", as in
Hugging Face's integration; any value the JSON gives wins):

- overlap_comm, contiguous_gradients, reduce_scatter: on (reduce-scatter the gradients on
  a side stream into one contiguous buffer while backward runs);
- reduce_bucket_size and stage3_prefetch_bucket_size: one transformer layer's parameters,
  so the next layer's all-gather is in flight while this one computes and a layer's
  gradients leave as one reduce-scatter (not per weight, not per 5e8 elements held back);
- stage3_param_persistence_threshold: 10 x hidden (norm weights and biases stay whole on
  every rank: a latency-bound all-gather each is dearer than their memory);
- stage3_max_live_parameters / stage3_max_reuse_distance: DeepSpeed's 1e9 (left as is).
"""
from __future__ import annotations

AUTO = "auto"


def layer_elements(model) -> int:
    """Parameters of one transformer layer of `model` (a ModelConfig): attention (q, kv
    with GQA, output), the MLP (two matrices, three with a gated activation), biases and
    norms are under 1% and left out."""
    h, heads, kv = model.hidden_size, model.num_attention_heads, model.num_key_value_heads
    kv_width = h // heads * kv
    gated = (model.activation or "").lower() in ("swiglu", "geglu")
    return 2 * h * h + 2 * h * kv_width + (3 if gated else 2) * h * model.ffn_hidden_size


def zero3_settings(model) -> dict:
    """The tuned zero_optimization keys of a ZeRO-3 run of `model` (module docstring)."""
    layer, h = layer_elements(model), model.hidden_size
    return {"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
            "reduce_bucket_size": layer, "stage3_prefetch_bucket_size": layer,
            "stage3_param_persistence_threshold": 10 * h}


def fill_zero(zero_section: dict, model) -> None:
    """In place: at stage 3, `zero3_settings(model)` wherever the section holds no value or
    "auto" (the user's values win); at stages 0-2, "auto" dropped (DeepSpeed's defaults)."""
    for key, value in zero3_settings(model).items():
        if zero_section.get(key, AUTO) != AUTO:
            continue
        if int(zero_section.get("stage", 0)) == 3:
            zero_section[key] = value
        else:
            zero_section.pop(key, None)
