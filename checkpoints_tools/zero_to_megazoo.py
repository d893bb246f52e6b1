"""A DeepSpeedEngine checkpoint (ZeRO-1/2/3 shards) -> an ordinary megazoo checkpoint.

    python checkpoints_tools/zero_to_megazoo.py --load DS_DIR --out O [--tp N --pp M --vpp V]

DS_DIR is a folder written by `megazoo.training.zero.DeepSpeedEngine.save` (DeepSpeed's files
under DS_DIR/<tag>/ plus DS_DIR/megazoo.json with the model config and layout). For each
tensor-parallel rank t, DeepSpeed's own `zero_to_fp32` reassembles the fp32 master weights
from the ZeRO partitions of that rank's files (`*mp_rank_{t:02d}_*`, linked into a scratch
folder so it sees one tp rank at a time); the tp shards are then joined with megazoo's shard
metadata (`tp_unslice` on the meta-device model of rank t) and streamed into a megazoo
checkpoint by `megazoo.checkpoint.write_checkpoint` at the layout asked for (default tp=1,
pp=1), loadable at any layout. The fp32 masters are used, so a bf16 run converts without loss.

Errors (not a DeepSpeedEngine folder, missing rank files, a layout that does not fit the
model) print one line and exit with code 2, writing nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _tp_rank_files(ds_dir: str, tp_rank: int) -> list[str]:
    mark = f"mp_rank_{tp_rank:02d}_"
    files = [f for f in os.listdir(ds_dir) if mark in f and f.endswith(".pt")]
    if not files:
        raise ValueError(f"{ds_dir} holds no DeepSpeed files of tp rank {tp_rank} (*{mark}*.pt)")
    return files


def tp_rank_state_dict(load: str, tag: str, tp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 {local name: tensor} of tp rank `tp_rank`, merged over its ZeRO partitions."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds_dir = os.path.join(load, tag)
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, tag))
        for f in _tp_rank_files(ds_dir, tp_rank):
            os.symlink(os.path.abspath(os.path.join(ds_dir, f)), os.path.join(tmp, tag, f))
        sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag)
    return {k: (v.materialize() if hasattr(v, "materialize") else v) for k, v in sd.items()}


def full_state_dict(load: str) -> tuple[object, dict[str, torch.Tensor], dict]:
    """(ModelConfig, {full name: full unpadded fp32 tensor}, DeepSpeed metadata)."""
    from megazoo.checkpoint import config_from_dict, rank_model
    from megazoo.layers.sharding import tp_unslice
    from megazoo.models import full_name
    from megazoo.training.zero import read_ds_metadata

    meta = read_ds_metadata(load)
    config = config_from_dict(meta["model"])
    tp = int(meta["layout"]["tp"])
    layout = {"tp": tp, "pp": 1, "vpp": 1}
    shards = [tp_rank_state_dict(load, meta["tag"], t) for t in range(tp)]
    reference = rank_model(config, layout, 0, 0)  # meta device: names and shard tags
    full = {}
    for name, p in reference.named_parameters():
        if getattr(p, "tied_to", None):
            continue
        missing = [t for t in range(tp) if name not in shards[t]]
        if missing:
            raise ValueError(f"{load}: parameter {name} is missing from tp ranks {missing}")
        full[full_name(name, p)] = tp_unslice([shards[t][name] for t in range(tp)], p)
    return config, full, meta


def convert(load: str, out: str, tp: int = 1, pp: int = 1, vpp: int = 1,
            dtype: torch.dtype | None = None) -> None:
    from megazoo.checkpoint import write_checkpoint

    config, full, meta = full_state_dict(load)
    extra = {"converted_from": "deepspeed", "zero_stage": meta.get("zero_stage"),
             "source_layout": meta["layout"], "source_extra": meta.get("extra") or {}}
    write_checkpoint(config, out, lambda name: full[name].to(dtype or torch.float32),
                     tp=tp, pp=pp, vpp=vpp, dtype=dtype or torch.float32, extra=extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True, help="DeepSpeedEngine checkpoint folder")
    parser.add_argument("--out", required=True, help="megazoo checkpoint folder to write")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write")
    parser.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        convert(args.load, args.out, args.tp, args.pp, args.vpp, dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (tp={args.tp}, pp={args.pp}, vpp={args.vpp}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
