"""A DeepSpeedEngine checkpoint (ZeRO-1/2/3 shards) -> an ordinary megazoo checkpoint.

DS_DIR is a folder a `--deepspeed` run saved (DeepSpeed's files under DS_DIR/<tag>/ plus
DS_DIR/megazoo.json with the model config and layout, `megazoo.checkpoint.deepspeed`). For each
tensor-parallel rank t, DeepSpeed's own `zero_to_fp32` reassembles the fp32 master weights
from the ZeRO partitions of that rank's files (`*mp_rank_{t:02d}_*`, linked into a scratch
folder so it sees one tp rank at a time); the tp shards are then joined with megazoo's shard
metadata (`tp_unslice` on the meta-device model of rank t) and streamed into a megazoo
checkpoint by `megazoo.checkpoint.write_checkpoint` at the layout asked for (default tp=1,
pp=1), loadable at any layout. The fp32 masters are used, so a bf16 run converts without loss.

Nothing is written before the input is verified: every DeepSpeed file against the checksum
its megazoo.json records (`megazoo.checkpoint.deepspeed`; `verify_checksums=False`,
--no-verify-checksums, skips it), and every reassembled tensor for inf / nan. A corrupted
shard is an error naming the file, never a converted checkpoint with fresh, valid checksums.
"""
from __future__ import annotations

import contextlib
import io
import os
import tempfile

import torch

from ..checkpoint import config_from_dict, rank_model, write_checkpoint
from ..checkpoint.deepspeed import check_files, check_finite_loaded, read_ds_metadata
from ..checkpoint.layout import stored_parameters
from ..checkpoint.output import check_output_dir
from ..checkpoint.resolve import resolve_checkpoint
from ..layers.sharding import tp_unslice
from ..models import ModelConfig


def tp_rank_state_dict(load: str, tag: str, tp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 {local name: tensor} of tp rank `tp_rank`, merged over its ZeRO partitions."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds_dir, mark = os.path.join(load, tag), f"mp_rank_{tp_rank:02d}_"
    files = [f for f in os.listdir(ds_dir) if mark in f and f.endswith(".pt")]
    if not files:
        raise ValueError(f"{ds_dir} holds no DeepSpeed files of tp rank {tp_rank} (*{mark}*.pt)")
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, tag))
        for f in files:
            os.symlink(os.path.abspath(os.path.join(ds_dir, f)), os.path.join(tmp, tag, f))
        with contextlib.redirect_stderr(io.StringIO()):  # DeepSpeed's progress bar
            sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag)
    return {k: (v.materialize() if hasattr(v, "materialize") else v) for k, v in sd.items()}


def full_state_dict(load: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(ModelConfig, {full name: full unpadded fp32 tensor}, DeepSpeed metadata)."""
    meta = read_ds_metadata(load)
    config = config_from_dict(meta["model"])
    tp = int(meta["layout"]["tp"])
    shards = [tp_rank_state_dict(load, meta["tag"], t) for t in range(tp)]
    reference = rank_model(config, {"tp": tp, "pp": 1, "vpp": 1}, 0, 0)  # names, shard tags
    full = {}
    for fname, (name, p) in stored_parameters(reference).items():
        missing = [t for t in range(tp) if name not in shards[t]]
        if missing:
            raise ValueError(f"{load}: parameter {name} is missing from tp ranks {missing}")
        full[fname] = tp_unslice([shards[t][name] for t in range(tp)], p)
    return config, full, meta


def zero_to_megazoo(load, out, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                    dtype: torch.dtype | None = None, overwrite: bool = False,
                    verify_checksums: bool = True) -> None:
    """Consolidate the DeepSpeedEngine checkpoint `load` into a megazoo checkpoint `out`
    (`overwrite` as in `hf_to_megazoo`; `out` is never `load` nor a folder containing it),
    after verifying it (see the module doc)."""
    load, out = os.fspath(load), os.fspath(out)
    check_output_dir(out, kind="megazoo", overwrite=overwrite, inputs=[load])
    folder = resolve_checkpoint(load)  # a --save folder: its latest
    check_files(folder, read_ds_metadata(folder), verify_checksums)
    config, full, meta = full_state_dict(folder)
    check_finite_loaded(full.items(), folder, allow="")
    extra = {"converted_from": "deepspeed", "zero_stage": meta.get("zero_stage"),
             "source_layout": meta["layout"], "source_extra": meta.get("extra") or {}}
    write_checkpoint(config, out, lambda name: full[name].to(dtype or torch.float32),
                     tp=tp, pp=pp, vpp=vpp, dtype=dtype or torch.float32, extra=extra,
                     overwrite=overwrite, inputs=[load])
