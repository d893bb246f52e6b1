"""The type of every ds_config key megazoo or DeepSpeed reads, checked when the JSON is loaded.

    check_types(ds, source)   # ValueError: one line naming the key, the value, the type

JSON values are not taken at face value: a string "false" for a boolean is truthy in Python,
and `true` for a ratio is 1.0. So each key of `SCHEMA` (dotted path from the top of the JSON)
must hold a value of its kind:

- `BOOL`: true or false (not "false", not 0);
- `INT`: an integer (not true, not 2.0);
- `SIZE`: an integer, also written as a whole float (DeepSpeed's configs write 5e8 bytes);
- `NUMBER`: an integer or a float, not a bool;
- `TEXT`: a string; `OBJECT`: a JSON object (a section).
Keys megazoo merges with a flag also accept "auto" ("take the flag's value"), and the
`null`-able ones null. Keys not in the table (other DeepSpeed features) are left to
DeepSpeed; the `sparse_attention` section is typed by `SparseAttentionConfig`.
"""
from __future__ import annotations

import json

BOOL, INT, SIZE, NUMBER, TEXT, OBJECT = ("a JSON bool (true or false)", "an integer",
                                         "an integer (a whole number)", "a number",
                                         "a string", "a JSON object")
AUTO, NULL = "or \"auto\"", "or null"

_OFFLOAD = {"device": (TEXT, NULL), "nvme_path": (TEXT, NULL), "pin_memory": (BOOL,),
            "buffer_count": (INT,), "buffer_size": (SIZE,), "max_in_cpu": (SIZE,),
            "fast_init": (BOOL,), "ratio": (NUMBER,), "pipeline_read": (BOOL,),
            "pipeline_write": (BOOL,), "pipeline": (BOOL,)}
# "auto" where megazoo fills in a value (`ds_tuning`, ZeRO-3)
_ZERO = {"stage": (INT,), "overlap_comm": (BOOL, NULL, AUTO),
         "contiguous_gradients": (BOOL, AUTO), "reduce_scatter": (BOOL, AUTO),
         "reduce_bucket_size": (SIZE, AUTO),
         "allgather_partitions": (BOOL,), "allgather_bucket_size": (SIZE,),
         "round_robin_gradients": (BOOL,), "load_from_fp32_weights": (BOOL,),
         "elastic_checkpoint": (BOOL,), "sub_group_size": (SIZE,),
         "stage3_max_live_parameters": (SIZE,), "stage3_max_reuse_distance": (SIZE,),
         "stage3_prefetch_bucket_size": (SIZE, AUTO),
         "stage3_param_persistence_threshold": (SIZE, AUTO),
         "stage3_gather_16bit_weights_on_model_save": (BOOL,),
         "stage3_gather_fp16_weights_on_model_save": (BOOL,),
         "ignore_unused_parameters": (BOOL,), "cpu_offload": (BOOL,),
         "offload_optimizer": (OBJECT, NULL), "offload_param": (OBJECT, NULL)}
_FP16 = {"enabled": (BOOL, AUTO), "loss_scale": (NUMBER,), "initial_scale_power": (INT,),
         "loss_scale_window": (INT,), "hysteresis": (INT,), "consecutive_hysteresis": (BOOL,),
         "min_loss_scale": (NUMBER,), "auto_cast": (BOOL,)}
_COMPRESSION = {"algorithm": (TEXT, NULL), "topk_ratio": (NUMBER,),
                "compression_start_step": (INT,), "compression_block_size": (INT,),
                "freeze_variance": (BOOL,), "compressed_momentum_share": (NUMBER,),
                "topk_selection": (TEXT,), "local_gradient_clipping": (BOOL,),
                "huffman_coding": (BOOL,)}
_AIO = {"block_size": (SIZE,), "queue_depth": (INT,), "thread_count": (INT,),
        "single_submit": (BOOL,), "overlap_events": (BOOL,)}

SCHEMA: dict[str, tuple[str, ...]] = {
    "train_batch_size": (INT, AUTO), "train_micro_batch_size_per_gpu": (INT, AUTO),
    "gradient_accumulation_steps": (INT, AUTO), "gradient_clipping": (NUMBER, AUTO),
    "steps_per_print": (INT,), "wall_clock_breakdown": (BOOL,), "memory_breakdown": (BOOL,),
    "prescale_gradients": (BOOL,), "gradient_predivide_factor": (NUMBER,),
    "zero_allow_untested_optimizer": (BOOL,), "zero_force_ds_cpu_optimizer": (BOOL,),
    "dump_state": (BOOL,), "communication_data_type": (TEXT, NULL),
    "bf16": (OBJECT,), "bf16.enabled": (BOOL, AUTO), "bf16.immediate_grad_update": (BOOL,),
    "fp16": (OBJECT,), **{f"fp16.{k}": v for k, v in _FP16.items()},
    "zero_optimization": (OBJECT,), **{f"zero_optimization.{k}": v for k, v in _ZERO.items()},
    **{f"zero_optimization.{s}.{k}": v for s in ("offload_optimizer", "offload_param")
       for k, v in _OFFLOAD.items()},
    "gradient_compression": (OBJECT,),
    **{f"gradient_compression.{k}": v for k, v in _COMPRESSION.items()},
    "aio": (OBJECT,), **{f"aio.{k}": v for k, v in _AIO.items()},
    "optimizer": (OBJECT,), "optimizer.type": (TEXT,), "optimizer.params": (OBJECT,),
    "scheduler": (OBJECT,), "sparse_attention": (OBJECT,),
    "data_types": (OBJECT,), "data_types.grad_accum_dtype": (TEXT,),
}


def _fits(value, kind: str) -> bool:
    if kind == AUTO:
        return value == "auto"
    if kind == NULL:
        return value is None
    if kind == BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):  # a bool is an int to Python, never a number here
        return False
    if kind == INT:
        return isinstance(value, int)
    if kind == SIZE:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == NUMBER:
        return isinstance(value, (int, float))
    return isinstance(value, str) if kind == TEXT else isinstance(value, dict)


def _walk(node: dict, prefix: str = ""):
    """(dotted key, value) of every key in `node`, sections included, depth first."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        yield dotted, value
        if isinstance(value, dict):
            yield from _walk(value, dotted + ".")


def check_types(ds: dict, source: str) -> None:
    """ValueError naming the first key of `ds` whose value is not of its `SCHEMA` kind."""
    for key, value in _walk(ds):
        kinds = SCHEMA.get(key)
        if kinds is not None and not any(_fits(value, k) for k in kinds):
            expected = " ".join(kinds)
            raise ValueError(f"{source}: {key} = {json.dumps(value)} must be {expected}: "
                             f"fix the JSON")
