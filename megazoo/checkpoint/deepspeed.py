"""The checkpoints megazoo writes in DeepSpeed's format (`DeepSpeedEngine.save`: DeepSpeed's
pickled shards under `DIR/<tag>/`, our `DIR/megazoo.json` beside them): that file's format,
writer and reader, and the files' integrity.

megazoo.json holds the model config, the layout and the ZeRO stage the files were written at,
so that resuming can refuse another layout and `checkpoints_tools/zero_to_megazoo.py` can
rebuild an ordinary megazoo checkpoint without the engine. DeepSpeed's files carry no
checksums (a flipped exponent bit in a ZeRO shard loads as a finite, wrong value), so
megazoo.json also records one per file under `FILES_KEY`; whatever reads such a checkpoint
verifies them first, then checks the values it loaded for inf / nan:

    algorithm, sums = record_checksums(folder, tag, state)   # collective, after the save
    check_files(folder, meta, verify, state, device)        # collective, before the load
    check_finite_loaded(tensors, folder, state, device)      # collective, after the load

The collective functions split the files over the ranks and raise on every rank if any
failed (`save.agree`). `state` None: one process.
"""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from .checksums import Hasher, check_algorithm, default_algorithm
from .files import READ_CHUNK, nonfinite_count
from .layout import METADATA_FILE
from .load import read_metadata
from .save import agree

DS_FORMAT = "megazoo-deepspeed-1"
FILES_KEY = "file_checksums"
UNCHECKED = "restore it, or read it unchecked with --no-verify-checksums"


def write_ds_metadata(path: str, meta: dict) -> None:
    """`path/megazoo.json` = meta plus the format, written whole or not at all."""
    tmp = os.path.join(path, f".{METADATA_FILE}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"format": DS_FORMAT, **meta}, f, indent=1)
    os.replace(tmp, os.path.join(path, METADATA_FILE))


def read_ds_metadata(path: str) -> dict:
    """`path/megazoo.json` of a DeepSpeedEngine checkpoint (clear errors otherwise)."""
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise ValueError(f"{path} is not a megazoo DeepSpeed checkpoint: megazoo.json is missing")
    return read_metadata(path, DS_FORMAT, " (an ordinary megazoo checkpoint loads with "
                                          "load_model_weights)")


def hash_file(path: str, algorithm: str) -> str:
    """Hex checksum of a whole file, read piece by piece."""
    hasher = Hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(READ_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def list_files(folder: str, tag: str) -> list[str]:
    """Every file under `folder/tag`, as sorted paths relative to `folder`."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder, tag).rglob("*") if p.is_file())


def _rank_world(state) -> tuple[int, int]:
    return (0, 1) if state is None else (state.global_rank, state.world_size)


def record_checksums(folder: str, tag: str, state) -> tuple[str, dict[str, str]]:
    """(hash name, {file relative to folder: hex}) of every file under `folder/tag`, each
    rank hashing its share. Collective; call after every rank's files are written."""
    rank, world = _rank_world(state)
    algorithm, files = default_algorithm(), list_files(folder, tag)
    sums = {f: hash_file(os.path.join(folder, f), algorithm) for f in files[rank::world]}
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, sums)
        sums = {f: h for share in shares for f, h in share.items()}
    return algorithm, sums


def verify_checksums(folder: str, meta: dict, state=None, device=None) -> None:
    """ValueError (on every rank) unless every file under `folder/<tag>` matches the checksum
    megazoo.json records for it and every recorded file is there. Collective."""
    where = os.path.join(folder, METADATA_FILE)
    rank, world = _rank_world(state)

    def check() -> None:
        algorithm, sums = meta.get("checksum"), meta.get(FILES_KEY)
        if not algorithm or not isinstance(sums, dict):
            raise ValueError(f"{where} records no checksums of DeepSpeed's files (no "
                             f"\"checksum\" / \"{FILES_KEY}\"): the file was edited or the "
                             f"checkpoint predates checksums; {UNCHECKED}")
        check_algorithm(algorithm, f"checkpoint {folder}")
        files = list_files(folder, meta.get("tag", ""))
        missing = sorted(set(sums) - set(files))
        if missing:
            raise ValueError(f"checkpoint file {os.path.join(folder, missing[0])} is missing: "
                             f"the checkpoint is incomplete")
        unrecorded = sorted(set(files) - set(sums))
        if unrecorded:
            raise ValueError(f"{where} records no checksum for {unrecorded[0]}: the file was "
                             f"edited or damaged; {UNCHECKED}")
        for name in files[rank::world]:
            got = hash_file(os.path.join(folder, name), algorithm)
            if got != sums[name]:
                raise ValueError(f"checkpoint file {os.path.join(folder, name)} is corrupted: "
                                 f"checksum {got}, megazoo.json recorded {sums[name]}; restore "
                                 f"the file or use another checkpoint (--no-verify-checksums "
                                 f"skips this check)")

    agree(check, state, device, ValueError(f"verifying {folder} failed on another rank (its "
                                           f"error names the file)"))


def check_files(folder: str, meta: dict, verify: bool, state=None, device=None) -> None:
    """Before DeepSpeed reads `folder`: every file against its checksum (`verify`), else at
    least every torch archive whole (its zip directory readable), so that a truncated file is
    one line naming it, not the loader's traceback on every rank. Collective."""
    if verify:
        verify_checksums(folder, meta, state, device)
        return
    rank, world = _rank_world(state)

    def check() -> None:
        for name in list_files(folder, meta.get("tag", ""))[rank::world]:
            path = os.path.join(folder, name)
            if name.endswith(".pt") and not zipfile.is_zipfile(path):
                raise ValueError(f"checkpoint file {path} is truncated or damaged (not a "
                                 f"readable torch archive): restore it or use another checkpoint")

    agree(check, state, device, ValueError(f"reading {folder} failed on another rank (its "
                                           f"error names the file)"))


def check_finite_loaded(tensors: Iterable[tuple[str, torch.Tensor]], folder: str, state=None,
                        device=None, allow: str = "--allow-nonfinite-load loads it anyway") -> None:
    """ValueError (on every rank) naming the first tensor of any rank's `tensors` ((name,
    tensor) pairs read from the checkpoint `folder`) that holds inf or nan. Collective."""
    def check() -> None:
        for name, tensor in tensors:
            bad = nonfinite_count(tensor.detach())
            if bad:
                raise ValueError(f"checkpoint {folder}: {name} holds {bad} non-finite value"
                                 f"{'s' if bad > 1 else ''} (inf or nan); use an earlier "
                                 f"checkpoint{f' ({allow})' if allow else ''}")

    agree(check, state, device, ValueError(f"checking {folder} for inf / nan failed on another "
                                           f"rank (its error names the file)"))
