"""Training checkpoints: `SAVE/iter_0000100/` per iteration and a `SAVE/latest` pointer.

    save_training_checkpoint(engine, save_dir, iteration, extra, state)
    extra = load_training_checkpoint(engine, load_dir)      # restores RNGs too

`engine.save` writes the folder (collective), with `extra` = {iteration, consumed_samples,
rng, args, ...}; only then does rank 0 replace `latest` (write-to-temp + os.replace), so a
crash mid-save, or a save refused for inf / nan (`NonFiniteError`, which the loop turns into
the run's stop), leaves `latest` naming the previous checkpoint. RNG states are lists of ints
(JSON), never pickled.

**A complete checkpoint is never replaced implicitly** (`check_save_target`, at setup and
before each save): only with `--overwrite-checkpoints` or when a save killed before moving
`latest` left it (the `SAVING` note names it), and then only when it holds nothing but what
the engine writes. Resuming from an earlier iteration therefore never deletes later ones.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.files import NonFiniteError
from ..checkpoint.layout import METADATA_FILE
from ..checkpoint.output import check_only_ours, fault_point
from ..checkpoint.resolve import LATEST, iteration_dir, read_latest, resolve_checkpoint

# The temp file `_write_note` renames over `latest` (left behind only by a killed run).
LATEST_TMP = r"\.latest\.tmp(?P<pid>\d+)"
# The note naming the iteration being saved, from before its folder is written until
# `latest` names it: a complete folder it names was left by a killed save, not by the user.
SAVING = ".megazoo-saving"


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


def _write_note(save_dir: str, name: str, iteration: int) -> None:
    """`save_dir/name` := the iteration, replaced atomically (write a temp file, rename)."""
    tmp = os.path.join(save_dir, f".{LATEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, name))


def where_latest_is(save_dir: str) -> str:
    """What `latest` names after a refused save, for the run's last line."""
    kept = read_latest(save_dir)
    return f"{LATEST} still names iteration {kept}" if kept is not None else \
        f"no {LATEST} was written"


def forget_saving(save_dir: str, unless_after: int | None = None) -> None:
    """Remove the `SAVING` note (rank 0), or keep it when it names an iteration later than
    `unless_after` (the note of a save killed before `latest` moved)."""
    noted = read_latest(save_dir, SAVING)
    if noted is not None and (unless_after is None or noted <= unless_after):
        try:
            os.remove(os.path.join(save_dir, SAVING))
        except FileNotFoundError:
            pass


def check_save_target(save_dir: str, iteration: int, kind: str, overwrite: bool,
                      resumed_from: int) -> bool:
    """Whether saving `iteration` replaces a checkpoint (True: the folder holds only what
    the engine writes and may be removed first; False: nothing to replace); ValueError (one
    line, naming the folder and the flag) when the save would lose something. `kind`: the
    engine's checkpoint kind (`output.KINDS`)."""
    path = iteration_dir(save_dir, iteration)
    if not os.path.lexists(path):
        return False
    if os.path.islink(path):  # replacing it would replace the link, not what it points to
        raise ValueError(f"--save {save_dir} holds {path}, a symbolic link (to "
                         f"{os.readlink(path)}): the run would replace it; remove the link or "
                         f"choose another --save")
    latest = read_latest(save_dir)
    killed = read_latest(save_dir, SAVING) == iteration and (latest is None or iteration > latest)
    complete = os.path.isfile(os.path.join(path, METADATA_FILE))
    if complete and not (overwrite or killed):
        raise ValueError(f"--save {save_dir} holds {path}, a complete checkpoint later than "
                         f"iteration {resumed_from} this run starts from: the run would replace "
                         f"it; resume from it (--load {path}), move it away, or pass "
                         f"--overwrite-checkpoints to replace it")
    if not complete and not killed:  # not this run's: refused unless an empty folder
        if os.path.isdir(path) and not os.listdir(path):
            return False
        raise ValueError(f"--save {save_dir} holds {path}, which is not a complete checkpoint "
                         f"({METADATA_FILE} is missing) nor left by a killed save of this run: "
                         f"move it away or choose another --save")
    # a save killed mid-way, or a checkpoint to replace: named as a run's output and its flag
    check_only_ours(path, kind, ("checkpoint folder", "--overwrite-checkpoints"))
    return True


def save_training_checkpoint(engine, save_dir: str, iteration: int, extra: dict, state, *,
                             overwrite: bool = False, resumed_from: int = 0) -> str:
    """Write `save_dir/iter_N` (collective), then point `latest` at it; return the path.

    An existing `iter_N` is replaced only as `check_save_target` allows (a ValueError on
    every rank otherwise, before anything is removed)."""
    path = iteration_dir(save_dir, iteration)
    replace = check_save_target(save_dir, iteration, getattr(engine, "checkpoint_kind", "megazoo"),
                                overwrite, resumed_from)
    if state.world_size > 1:
        dist.barrier()  # every rank has checked before rank 0 removes anything
    if state.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _write_note(save_dir, SAVING, iteration)
        if replace:
            shutil.rmtree(path)
    if state.world_size > 1:
        dist.barrier()
    try:
        engine.save(path, {**extra, "iteration": iteration, "rng": rng_state()})
    except NonFiniteError as exc:
        if state.global_rank == 0:
            forget_saving(save_dir)
        raise NonFiniteError(f"{exc}; {where_latest_is(save_dir)}") from None
    if state.global_rank == 0:
        fault_point("before-latest", path)
        _write_note(save_dir, LATEST, iteration)
        forget_saving(save_dir)
    if state.world_size > 1:
        dist.barrier()
    return path


def load_training_checkpoint(engine, load: str) -> dict:
    """Restore model, optimizer, scaler (engine) and RNG states; return the checkpoint's extra."""
    extra = engine.load(resolve_checkpoint(load))
    if "rng" in extra:
        set_rng_state(extra["rng"])
    return extra
