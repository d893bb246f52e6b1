"""A checkpoint's attention layout is part of its model: resuming keeps it.

`ModelConfig.sparse_attention` (the ds_config `sparse_attention` section, normalised) is saved
in megazoo.json with the rest of the model config, but it changes no weight shape, so nothing
else compares it. A run resumed with `--load` and no sparse flags (nor JSON section) takes the
checkpoint's layout; a run that states another layout (dense against sparse, or another
pattern) is refused, naming both, since training on would silently change the model.
"""
from __future__ import annotations

import json
import os

from ..errors import read_json
from .layout import METADATA_FILE
from .resolve import resolve_checkpoint


def _describe(section: dict | None) -> str:
    if section is None:
        return "dense attention"
    return f"sparse attention {json.dumps(section, sort_keys=True)}"


def resume_sparse_layout(current: dict | None, load: str) -> tuple[dict | None, str | None]:
    """(the sparse_attention section the resumed run must use, a note to print or None) for a
    run whose flags give `current` (None: none given) resuming from `load`; ValueError when
    the run states a layout other than the checkpoint's."""
    meta = read_json(os.path.join(resolve_checkpoint(load), METADATA_FILE),
                     advice="the checkpoint is damaged")
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    recorded = model.get("sparse_attention")
    if current == recorded:
        return current, None
    if current is None:
        return recorded, (f"resuming with the checkpoint's {_describe(recorded)} (it is part of "
                          f"the model; the run gave no sparse attention settings)")
    raise ValueError(f"--load {load} was trained with {_describe(recorded)}, this run asks for "
                     f"{_describe(current)}: drop the sparse attention flags (and the "
                     f"ds_config sparse_attention section) to resume with the checkpoint's, or "
                     f"start a new run")
