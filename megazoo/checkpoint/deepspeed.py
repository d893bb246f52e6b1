"""The `megazoo.json` beside a DeepSpeedEngine checkpoint: its format, writer and reader.

A `--deepspeed` run saves DeepSpeed's own files under `DIR/<tag>/` and this file at `DIR/`
(the model config, the layout and the ZeRO stage the files were written at), so that
resuming can refuse another layout and `checkpoints_tools/zero_to_megazoo.py` can rebuild
an ordinary megazoo checkpoint without the engine.
"""
from __future__ import annotations

import json
import os

DS_FORMAT = "megazoo-deepspeed-1"
METADATA_FILE = "megazoo.json"


def write_ds_metadata(path: str, meta: dict) -> None:
    """`path/megazoo.json` = meta plus the format, written whole or not at all."""
    tmp = os.path.join(path, f".{METADATA_FILE}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"format": DS_FORMAT, **meta}, f, indent=1)
    os.replace(tmp, os.path.join(path, METADATA_FILE))


def read_ds_metadata(path: str) -> dict:
    """`path/megazoo.json` of a DeepSpeedEngine checkpoint (clear errors otherwise)."""
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path} is not a megazoo DeepSpeed checkpoint: megazoo.json is missing")
    with open(file) as f:
        meta = json.load(f)
    if meta.get("format") != DS_FORMAT:
        raise ValueError(f"{file}: format {meta.get('format')!r} is not {DS_FORMAT!r} "
                         "(an ordinary megazoo checkpoint loads with load_model_weights)")
    return meta
