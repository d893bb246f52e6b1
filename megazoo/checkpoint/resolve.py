"""Which checkpoint folder a `--load` (or `load_pretrained(path)`) means.

A training run's `--save` folder holds `iter_0000100/`, `iter_0000200/`, ... and a `latest`
file naming the newest complete one. Everything that reads a checkpoint (resuming,
`load_pretrained`, the converters, resharding) accepts either form, through this one function:

    resolve_checkpoint("checkpoints")                  # -> "checkpoints/iter_0000800"
    resolve_checkpoint("checkpoints/iter_0000400")     # -> itself (it holds megazoo.json)

A missing folder, one holding neither, or a `latest` naming a missing folder is a
`CheckpointNotFound` (both a FileNotFoundError and a ValueError, what the command lines turn
into one "error: ..." line); a `latest` that is not a number (or not text) is a ValueError
naming it.
"""
from __future__ import annotations

import os
import re

from ..errors import read_text
from .layout import METADATA_FILE

LATEST = "latest"
# Where `output.publish` keeps the previous checkpoint while it renames the new one in.
OLD_SUFFIX = ".megazoo-old"


class CheckpointNotFound(FileNotFoundError, ValueError):
    """No checkpoint where a path points; the message says what to pass instead."""


def iteration_dir(save_dir: str, iteration: int) -> str:
    """`save_dir/iter_0000100` for iteration 100."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def read_latest(save_dir: str, name: str = LATEST) -> int | None:
    """The iteration `save_dir/latest` names (None: no such file, or not a number); `name`:
    another note of a --save folder holding one iteration number."""
    try:
        with open(os.path.join(save_dir, name), "rb") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # bytes: any text that is not digits


def previous_checkpoint(save_dir: str, before: int) -> str | None:
    """The newest `iter_N` folder of `save_dir` with N < `before` and a megazoo.json."""
    found = []
    for name in os.listdir(save_dir):
        match = re.fullmatch(r"iter_(\d+)", name)
        if match and int(match[1]) < before and \
                os.path.isfile(os.path.join(save_dir, name, METADATA_FILE)):
            found.append((int(match[1]), os.path.join(save_dir, name)))
    return max(found)[1] if found else None


def resolve_checkpoint(path) -> str:
    """The checkpoint folder `path` means: itself when it holds megazoo.json, else the
    iter_* folder its `latest` names (see the module docstring)."""
    path = os.path.normpath(os.fspath(path))
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return path
    if not os.path.isdir(path):
        old = path + OLD_SUFFIX
        hint = (f" (an interrupted save left the previous checkpoint at {old}: rename it back)"
                if os.path.isdir(old) else "")
        raise CheckpointNotFound(f"no checkpoint directory at {path}{hint}")
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        newest = previous_checkpoint(path, 10 ** 12)
        hint = f" (it holds {newest}: pass that)" if newest else ""
        raise CheckpointNotFound(f"{path} is not a megazoo checkpoint ({METADATA_FILE} is "
                                 f"missing) nor a --save folder (no {LATEST} file){hint}; pass "
                                 f"a --save folder or one of its iter_* folders")
    text = read_text(latest).strip()
    if not text.isdigit():
        raise ValueError(f"{latest} holds {text!r}, not an iteration number: fix or delete it")
    found = iteration_dir(path, int(text))
    if not os.path.isdir(found):
        earlier = previous_checkpoint(path, int(text))
        hint = (f"; the previous checkpoint {earlier} is there: resume from it with --load "
                f"{earlier}" if earlier else "; no earlier iter_* checkpoint is there either")
        raise CheckpointNotFound(f"{latest} names iteration {text} but {found} is missing{hint}")
    return found


def input_folders(path) -> list[str]:
    """The real paths (symlinks followed) an input path stands for: itself and, when it is a
    checkpoint or a --save folder, the checkpoint folder it resolves to (its `latest`).
    A writer compares its output with all of them (`output.check_output_dir`)."""
    folders = [os.path.realpath(os.fspath(path))]
    try:
        resolved = os.path.realpath(resolve_checkpoint(path))
    except (ValueError, OSError):  # not a checkpoint (an HF folder, a missing path)
        return folders
    return folders if resolved in folders else folders + [resolved]
