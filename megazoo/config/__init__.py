"""The configuration of a run, below every other package: what to build and how to lay it out.

| module | holds |
|---|---|
| `model.py` | `ModelConfig` (GPT / BLOOM / LLaMA shapes and conventions) |
| `presets.py` | `PRESETS`: the published model shapes |
| `layout.py` | `check_layout`: a model against a parallel layout, pure arithmetic |
| `precision.py` | `FP8Recipe`: how the linears' GEMMs run in FP8 |
| `sparse_attention.py` | `SparseAttentionConfig` (a ds_config `sparse_attention` section), flags |
| `run.py` | `PretrainArgs` and its sections (training, data, checkpoint, logging) |
| `zero.py` | `ZeroConfig`: the ZeRO / DeepSpeed / FSDP2 flags |
| `compression.py` | `CompressionConfig`: compressed gradient communication |
| `ds_config.py` | a DeepSpeed JSON: `merge_flags` (its one merge with the flags), the engine's dict |
| `flags.py` | the `pretrain_gpt.py` command line, generated from the dataclasses |
| `validate.py` | `check_args`: every check of a run that needs no process |

`models/`, `layers/`, `plan/`, `convert/` and `training/` read these; nothing here imports
them (`ParallelConfig` comes from `megazoo.parallel`).
"""
