"""Training checkpoints: `SAVE/iter_0000100/` per iteration and a `SAVE/latest` pointer.

    save_training_checkpoint(engine, save_dir, iteration, extra, state)
    extra = load_training_checkpoint(engine, load_dir)      # restores RNGs too

A checkpoint directory is written by `engine.save` (collective; `megazoo.save_checkpoint`
publishes it atomically), with `extra` = {iteration, consumed_samples, rng, args, ...}
plus the engine's own (optimizer step, loss scaler). Only after it is complete does rank 0
replace `latest` (a text file holding the iteration) by write-to-temp + os.replace, so a
crash mid-save leaves the previous checkpoint loadable and `latest` pointing at it.
RNG states are stored as lists of ints (JSON), never pickled. A save refused for inf / nan
in a tensor (`NonFiniteError`, raised by every engine's save) leaves `latest` where it was,
and the error says so; the training loop turns it into the run's stop
(`nonfinite.stopped_by_nonfinite_save`).
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.files import NonFiniteError
from ..checkpoint.output import fault_point
from ..checkpoint.resolve import LATEST, iteration_dir, read_latest, resolve_checkpoint

# The temp file `_write_latest` renames over `latest` (left behind only by a killed run).
LATEST_TMP = r"\.latest\.tmp(?P<pid>\d+)"


def rng_state() -> dict:
    """torch CPU, numpy and random states as JSON-able lists of ints."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_py = random.getstate()
    return {"torch": torch.get_rng_state().tolist(),
            "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)],
            "random": [version, list(internal), gauss_py]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_py = state["random"]
    random.setstate((version, tuple(internal), gauss_py))


def _write_latest(save_dir: str, iteration: int) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def save_training_checkpoint(engine, save_dir: str, iteration: int, extra: dict, state, *,
                             overwrite: bool = False) -> str:
    """Write `save_dir/iter_N` (collective), then point `latest` at it; return the path.

    An existing `iter_N` holding a checkpoint is replaced (removed first) when `latest` does
    not reach it (a save killed between publishing it and moving `latest`; setup has checked
    the folder is this run's) or with `overwrite` (--overwrite-checkpoints); else refused."""
    path = iteration_dir(save_dir, iteration)
    if state.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        latest = read_latest(save_dir)
        unreferenced = latest is None or iteration > latest  # left by a save killed before latest
        if (overwrite or unreferenced) and os.path.isfile(os.path.join(path, "megazoo.json")):
            shutil.rmtree(path)
    if state.world_size > 1:
        dist.barrier()
    try:
        engine.save(path, {**extra, "iteration": iteration, "rng": rng_state()})
    except NonFiniteError as exc:
        kept = read_latest(save_dir)
        where = f"{LATEST} still names iteration {kept}" if kept is not None else \
            f"no {LATEST} was written"
        raise NonFiniteError(f"{exc}; {where}") from None
    if state.global_rank == 0:
        fault_point("before-latest", path)
        _write_latest(save_dir, iteration)
    if state.world_size > 1:
        dist.barrier()
    return path


def load_training_checkpoint(engine, load: str) -> dict:
    """Restore model, optimizer, scaler (engine) and RNG states; return the checkpoint's extra."""
    extra = engine.load(resolve_checkpoint(load))
    if "rng" in extra:
        set_rng_state(extra["rng"])
    return extra
