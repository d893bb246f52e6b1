"""The error-feedback state of compressed gradient reductions in a checkpoint.

Each rank's residuals belong to that rank (its worker error over its buckets, its server
error over its chunk of each bucket), so each rank writes its own file into the checkpoint
folder before it is published: `compression/rank{global rank:05d}.safetensors`, fp32, keyed
"bucket{i}.worker" / "bucket{i}.server", with its checksums beside it
(`rank00000.safetensors.checksums.json`: the hash's name and one value per tensor, checked
on load). `describe` records what the
files depend on in the engine's metadata (algorithm, block / ratio, layout, bucket sizes);
a resume whose run differs in any of them (dp changed, another algorithm, other buckets)
starts from zero residuals, with one warning naming the difference, since the residuals of
one layout mean nothing in another.
"""
from __future__ import annotations

import json
import os

import torch

from ..checkpoint.checksums import CRC32, Hasher, check_algorithm
from ..checkpoint.files import (NonFiniteError, SafetensorsWriter, check_finite, read_header,
                                read_tensor, write_json)

FOLDER = "compression"


def describe(reduction, buffers, state) -> dict:
    """What the saved residuals depend on (stored under engine["compression"])."""
    return {"algorithm": type(reduction).__name__, "bits": getattr(reduction, "bits", None),
            "block": getattr(reduction, "block", None), "ratio": getattr(reduction, "ratio", None),
            "dp": state.dp.size, "sp": state.sp.size, "tp": state.tp.size, "pp": state.pp.size,
            "buckets": [b.numel for b in buffers.buckets]}


def _file(folder: str, rank: int) -> str:
    return os.path.join(folder, FOLDER, f"rank{rank:05d}.safetensors")


def write_errors(errors: dict[str, torch.Tensor], folder: str, rank: int) -> None:
    """This rank's residuals into `folder` (the checkpoint's temp dir), with checksums."""
    file = _file(folder, rank)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    specs = {k: (torch.float32, tuple(t.shape)) for k, t in sorted(errors.items())}
    with SafetensorsWriter(file, specs) as writer:
        for key in specs:
            writer.write(key, errors[key])
    write_json(file + ".checksums.json", {"checksum": writer.algorithm,
                                          "values": writer.checksums})


def _difference(saved: dict, here: dict) -> str | None:
    for key, what in (("algorithm", "algorithm"), ("bits", "bits"), ("block", "block size"),
                      ("ratio", "topk ratio"), ("dp", "dp"), ("sp", "sp"), ("tp", "tp"),
                      ("pp", "pp"), ("buckets", "bucket sizes")):
        if saved.get(key) != here.get(key):
            return f"{what} {saved.get(key)} (this run {here.get(key)})"
    return None


def read_errors(path: str, saved: dict | None, here: dict, rank: int, device: torch.device,
                verify_checksums: bool = True,
                allow_nonfinite: bool = False) -> tuple[dict, str | None]:
    """({name: tensor}, None), or ({}, the warning) when the saved state does not fit here.
    Each tensor is checked against its checksum and for inf / nan, as checkpoint tensors are
    (`megazoo.checkpoint.load`), unless the run's --no-verify-checksums /
    --allow-nonfinite-load say otherwise."""
    if saved is None:  # written without compression, or before it started: nothing to carry
        return {}, None
    diff = _difference(saved, here)
    if diff is not None:
        return {}, (f"the checkpoint's gradient-compression residuals were saved with {diff}: "
                    f"dropping them and starting from zero residuals (the gradient they still "
                    f"held back is lost)")
    file = _file(path, rank)
    if not os.path.isfile(file):
        raise ValueError(f"{path} lacks {os.path.relpath(file, path)}, this rank's "
                         f"gradient-compression residuals: the checkpoint is incomplete")
    algorithm, sums = _recorded(file) if verify_checksums else (CRC32, None)
    start, entries = read_header(file)
    out = {}
    with open(file, "rb", buffering=0) as f:
        for key, entry in entries.items():
            hasher = Hasher(algorithm) if sums is not None else None
            try:
                tensor = read_tensor(f, start, entry, hasher)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{file}: cannot read {key!r} ({exc})") from None
            if hasher is not None and hasher.hexdigest() != sums.get(key):
                raise ValueError(f"{file} is corrupted: tensor {key!r} does not match its "
                                 f"checksum (or has none); --no-verify-checksums skips the check")
            if not allow_nonfinite:
                try:
                    check_finite(key, tensor)
                except NonFiniteError as exc:
                    raise ValueError(f"{file}: {exc}; --allow-nonfinite-load loads it anyway") \
                        from None
            out[key] = tensor.to(device)
    return out, None


def _recorded(file: str) -> tuple[str, dict]:
    """(hash name, {key: hex}) of a residual file's checksum note (ValueError if unreadable)."""
    note = file + ".checksums.json"
    try:
        with open(note) as f:
            recorded = json.load(f)
        algorithm, sums = recorded.get("checksum", CRC32), recorded["values"]
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"{note} cannot be read ({exc}): restore it, or resume unchecked with "
                         f"--no-verify-checksums") from None
    check_algorithm(algorithm, file)
    return algorithm, sums
