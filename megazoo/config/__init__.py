"""The configuration of a run, below every other package: what to build and how to lay it out.

| module | holds |
|---|---|
| `model.py` | `ModelConfig` (GPT / BLOOM / LLaMA shapes and conventions) |
| `presets.py` | `PRESETS`: the published model shapes |
| `run.py` | `PretrainArgs` and its sections (training, data, checkpoint, logging) |
| `zero.py` | `ZeroConfig`: the ZeRO / DeepSpeed / FSDP2 flags |
| `compression.py` | `CompressionConfig`: compressed gradient communication |
| `sparse_attention.py` | `SparseAttentionConfig`: a ds_config `sparse_attention` section |
| `ds_config.py` | a DeepSpeed JSON: reading it, and the dict DeepSpeed's engine gets |
| `sparse.py` | the sparse attention flags |
| `flags.py` | the `pretrain_gpt.py` command line, generated from the dataclasses |
| `validate.py` | `check_args`: every check of a run that needs no process |

`models/`, `plan/`, `convert/` and `training/` read these; nothing here imports them.
"""
