"""Block-sparse attention of a run, from the `sparse_attention` section of `--deepspeed_config`
(read by every engine, not only DeepSpeed's) and the flags

    --sparse-attention-mode fixed --sparse-block 16 --sparse-attention-config '{"num_local_blocks": 4}'

(`--sparse-attention-config`: a JSON object with the section's other keys). A key given both
in the JSON file and by a flag must agree; the merged section becomes
`ModelConfig.sparse_attention` (validated there). Engines other than DeepSpeed use only the
JSON's sparse section and the training values (`ds_config.training_defaults_from_json`); one
warning line names the sections they ignore. DeepSpeed's engine gets the rest of the JSON, not
this section (`ds_config.build_ds_config`).
"""
from __future__ import annotations

import json
import os
import sys

from .ds_config import JSON_TRAINING_KEYS, SPARSE_SECTION as SECTION, load_ds_json

FLAGS = {"mode": "--sparse-attention-mode", "block": "--sparse-block"}
# Top-level keys of a ds_config that the plain and FSDP2 engines read.
READ_BY_ALL = {SECTION, "gradient_accumulation_steps", "gradient_compression",
               "communication_data_type"} | {k[0] for k in JSON_TRAINING_KEYS.values()}


def add_sparse_flags(parser) -> None:
    group = parser.add_argument_group("sparse attention", "Block-sparse attention (DeepSpeed's "
                                      "sparse_attention keys; see README).")
    group.add_argument("--sparse-attention-mode", dest="sparse__mode", default=None,
                       metavar="MODE", help="dense, fixed, variable, bigbird or bslongformer (default: the "
                       "--deepspeed_config section's, else dense)")
    group.add_argument("--sparse-block", dest="sparse__block", type=int, default=None,
                       metavar="N", help="tokens per block side, a power of two >= 16 (default: the "
                       "section's, else 16)")
    group.add_argument("--sparse-attention-config", dest="sparse__config", default=None,
                       metavar="JSON", help="JSON object with the other sparse_attention keys (default: "
                       "none: the section's, else each mode's defaults)")


def sparse_section(ns, deepspeed_config: str | None) -> dict | None:
    """The merged `sparse_attention` section (None: no sparse attention asked for)."""
    flags = _flag_section(ns)
    from_json = None
    if deepspeed_config:
        from_json = load_ds_json(deepspeed_config).get(SECTION)
        if from_json is not None and not isinstance(from_json, dict):
            raise ValueError(f"--deepspeed_config {deepspeed_config}: \"{SECTION}\" must be a "
                             f"JSON object, got {type(from_json).__name__}")
    if flags is None:
        return from_json
    merged = dict(from_json or {})
    for key, value in flags.items():
        if key in merged and merged[key] != value:
            given = key in FLAGS and getattr(ns, f"sparse__{key}", None) is not None
            flag = FLAGS[key] if given else f"--sparse-attention-config's {key!r}"
            raise ValueError(f"--deepspeed_config {deepspeed_config} sets {SECTION}.{key} = "
                             f"{merged[key]!r} but {flag} gives {value!r}: make them agree")
        merged[key] = value
    return merged


def _flag_section(ns) -> dict | None:
    out = {}
    raw = getattr(ns, "sparse__config", None)
    if raw is not None:
        try:
            out = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--sparse-attention-config is not valid JSON: {exc}") from None
        if not isinstance(out, dict):
            raise ValueError(f"--sparse-attention-config must be a JSON object, got "
                             f"{type(out).__name__}")
    for key, flag in FLAGS.items():
        value = getattr(ns, f"sparse__{key}", None)
        if value is None:
            continue
        if key in out and out[key] != value:
            raise ValueError(f"--sparse-attention-config sets {key} = {out[key]!r} but {flag} "
                             f"gives {value!r}: make them agree")
        out[key] = value
    return out or None


def warn_unused_sections(deepspeed_config: str | None, zero_impl: str) -> None:
    """One stderr line naming the ds_config sections an engine other than DeepSpeed ignores."""
    if not deepspeed_config or zero_impl == "deepspeed" or os.environ.get("RANK", "0") != "0":
        return
    unused = sorted(set(load_ds_json(deepspeed_config)) - READ_BY_ALL)
    if unused:
        engine = "the plain engine" if zero_impl == "none" else f"--zero-impl {zero_impl}"
        print(f"warning: --deepspeed_config {deepspeed_config}: {engine} ignores "
              f"{', '.join(unused)} (read only with --deepspeed)", file=sys.stderr, flush=True)
