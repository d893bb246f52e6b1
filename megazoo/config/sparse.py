"""Block-sparse attention of a run, from the `sparse_attention` section of `--deepspeed_config`
(read by every engine, not only DeepSpeed's) and the flags

    --sparse-attention-mode fixed --sparse-block 16 --sparse-attention-config '{"num_local_blocks": 4}'

(`--sparse-attention-config`: a JSON object with the section's other keys). The flags and the
JSON merge by `ds_config.merge_flags`'s rule, key by key; the merged section becomes
`ModelConfig.sparse_attention` (validated there, `sparse_attention.py`). DeepSpeed's engine
gets the rest of the JSON, not this section (`ds_config.build_ds_config`).
"""
from __future__ import annotations

import json

from .ds_config import SPARSE_SECTION as SECTION, JsonKey, merge_flags

FLAGS = {"mode": "--sparse-attention-mode", "block": "--sparse-block"}
CONFIG_FLAG = "--sparse-attention-config"


def add_sparse_flags(parser) -> None:
    group = parser.add_argument_group("sparse attention", "Block-sparse attention (DeepSpeed's "
                                      "sparse_attention keys; see README).")
    group.add_argument(FLAGS["mode"], dest="sparse__mode", default=None,
                       metavar="MODE", help="dense, fixed, variable, bigbird or bslongformer (default: the "
                       "--deepspeed_config section's, else dense)")
    group.add_argument(FLAGS["block"], dest="sparse__block", type=int, default=None,
                       metavar="N", help="tokens per block side, a power of two >= 16 (default: the "
                       "section's, else 16)")
    group.add_argument(CONFIG_FLAG, dest="sparse__config", default=None,
                       metavar="JSON", help="JSON object with the other sparse_attention keys (default: "
                       "none: the section's, else each mode's defaults)")


def sparse_section(ns, ds: dict, source: str) -> dict | None:
    """The merged `sparse_attention` section of the flags in `ns` and the ds_config `ds`
    (None: no sparse attention asked for)."""
    flags = _flag_section(ns)
    from_json = ds.get(SECTION)  # a JSON object: `read_ds_config` checked its type
    if not flags and from_json is None:
        return None
    keys = [JsonKey(k, (SECTION, k), _flag(ns, k)) for k in {**(from_json or {}), **flags}]
    return merge_flags(ds, flags, keys, source)


def _flag(ns, key: str) -> str:
    """The flag that gave `key`: its own, or the --sparse-attention-config object."""
    if key in FLAGS and getattr(ns, f"sparse__{key}", None) is not None:
        return FLAGS[key]
    return f"{CONFIG_FLAG}'s {key!r}"


def _flag_section(ns) -> dict:
    """--sparse-attention-config's object with --sparse-attention-mode / --sparse-block
    merged in (the same rule: a key both give must agree)."""
    config = {}
    raw = getattr(ns, "sparse__config", None)
    if raw is not None:
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{CONFIG_FLAG} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_FLAG} must be a JSON object, got {type(config).__name__}")
    given = {k: getattr(ns, f"sparse__{k}") for k in FLAGS
             if getattr(ns, f"sparse__{k}", None) is not None}
    merged = merge_flags({SECTION: config}, given,
                         [JsonKey(k, (SECTION, k), FLAGS[k]) for k in given], CONFIG_FLAG)
    return {**config, **merged}
