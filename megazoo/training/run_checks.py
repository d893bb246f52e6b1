"""Checks of a run against the checkpoints around it, made at setup before the first step:
--save writable and not another run's (`prepare_save_dir`), no complete checkpoint replaced
implicitly (`check_save_targets`), data settings that differ from the checkpoint's
(`resume_warnings`), and how --load is read (`read_options`).

A `--save` folder belongs to one run: a run that does not resume from it (no `--load` of that
folder) and finds checkpoints there is refused, so it never moves another run's `latest`;
`--overwrite-checkpoints` lets it save over them. Every rank makes the same checks on the same
files, so a refusal happens on all ranks before any collective.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from ..checkpoint.load import SHAPE_FIELDS
from ..checkpoint.output import remove_leftovers
from ..checkpoint.resolve import (iteration_dir, previous_checkpoint, read_latest,
                                  resolve_checkpoint)
from ..errors import read_json, user_path
from .checkpoint import LATEST_TMP, check_save_target, forget_saving
from .lr_schedule import learning_rate


def read_options(args) -> dict:
    """Keyword arguments of `load_model_weights` for resuming with these args."""
    return {"verify_checksums": args.checkpoint.verify_checksums,
            "allow_nonfinite": args.checkpoint.allow_nonfinite_load}


def _newest_checkpoint(save: str) -> tuple[int, dict] | None:
    """(iteration, megazoo.json) of the checkpoint `latest` names, else of the newest
    iter_* folder; None when the folder holds no checkpoint."""
    iteration = read_latest(save)
    path = iteration_dir(save, iteration) if iteration is not None else None
    if path is None or not os.path.isdir(path):
        path = previous_checkpoint(save, 10 ** 12) if os.path.isdir(save) else None
    if path is None:
        return None
    try:
        meta = read_json(os.path.join(path, "megazoo.json"))
    except ValueError:  # unreadable: no settings to compare
        meta = {}
    return int(os.path.basename(path).removeprefix("iter_")), meta


def _differences(args, meta: dict) -> list[str]:
    """'hidden_size 256 (this run 128)' for each model shape field and the seed that differ."""
    theirs = dict(meta.get("model") or {})
    run_args = (meta.get("extra") or {}).get("args") or {}
    theirs["seed"] = (run_args.get("training") or {}).get("seed")
    ours = {f: getattr(args.model, f) for f in SHAPE_FIELDS}
    ours["seed"] = args.training.seed
    return [f"{field} {theirs[field]} (this run {ours[field]})" for field in ours
            if theirs.get(field) is not None and theirs[field] != ours[field]]


def _resumes_from(args, save: str) -> bool:
    """Whether --load is the --save folder or one of its checkpoints (real paths compared,
    symlinks followed, --load taken as the checkpoint folder it resolves to)."""
    load = args.checkpoint.load
    if not load:
        return False
    try:
        folder = resolve_checkpoint(load)
    except (ValueError, OSError):
        folder = load  # setup's load names the problem
    save = os.path.realpath(save)
    return save in (os.path.realpath(load), os.path.realpath(folder),
                    os.path.realpath(os.path.dirname(os.path.normpath(folder))))


def check_writable(save: str) -> None:
    """Create --save and write a file into it now, so a read-only file system, a file in the
    way or a refused permission is one line before the first step, not after the last (a
    folder made only for this is removed again, by a run of one rank: with several, one
    rank's removal could pull the folder from under another's probe)."""
    probe = os.path.join(save, f".megazoo-write-test.{os.getpid()}")
    created = int(os.environ.get("WORLD_SIZE", "1")) == 1 and not os.path.isdir(save)
    with user_path("--save", save):
        os.makedirs(save, exist_ok=True)
        with open(probe, "w") as f:
            f.write("megazoo\n")
        os.remove(probe)
        if created:  # made again at the first save: a run refused later leaves no folder
            try:
                os.rmdir(save)
            except OSError:
                pass  # it has gone


def prepare_save_dir(args, rank0: bool, log) -> None:
    """Check --save can be written, remove `.latest.tmp<pid>` files of dead runs (rank 0),
    then refuse a --save folder holding another run's checkpoints unless
    --overwrite-checkpoints (every rank)."""
    save = args.checkpoint.save
    if not save:
        return
    parent = os.path.dirname(os.path.abspath(save))
    if re.fullmatch(r"iter_\d+", os.path.basename(os.path.normpath(save))) and (
            os.path.isfile(os.path.join(save, "megazoo.json"))
            or os.path.isfile(os.path.join(parent, "latest"))):
        raise ValueError(f"--save {save} is one checkpoint of a --save folder; new checkpoints "
                         f"would nest inside it: pass --save {parent}")
    check_writable(save)
    if rank0:
        for path in remove_leftovers(save, LATEST_TMP):
            log(f"removed {path}, left by a killed run")
        if os.path.isdir(save):
            forget_saving(save, unless_after=read_latest(save))
    found = _newest_checkpoint(save)
    if found is None or _resumes_from(args, save):
        return
    iteration, meta = found
    diffs = _differences(args, meta)
    what = (f"another run's checkpoints (iteration {iteration}: {', '.join(diffs)})" if diffs
            else f"checkpoints up to iteration {iteration} of an earlier run")
    if args.checkpoint.overwrite_checkpoints:
        log(f"warning: --save {save} holds {what}; --overwrite-checkpoints: saving over them")
        return
    raise ValueError(f"--save {save} holds {what}: pass --load {save} to resume it, choose "
                     f"another --save, or pass --overwrite-checkpoints to save over them")


def saved_iterations(args, start: int, iterations) -> list[int]:
    """Those of `iterations` that a run starting at `start` will save (as the loop decides:
    every --save-interval, every --exit-interval, which also ends the run, and the last)."""
    t, every = args.training, args.checkpoint.save_interval
    last = t.train_iters
    if t.exit_interval:
        last = min(last, (start // t.exit_interval + 1) * t.exit_interval)
    return sorted(n for n in iterations if start < n <= last and (
        n == last or (every and n % every == 0)))


def check_save_targets(args, start: int, kind: str) -> None:
    """Before the first step (every rank): each existing iter_* folder of --save that the run
    will write passes `checkpoint.check_save_target` (a ValueError naming it otherwise)."""
    save = args.checkpoint.save
    if not save or not os.path.isdir(save):
        return
    found = [int(m[1]) for name in os.listdir(save) if (m := re.fullmatch(r"iter_(\d+)", name))]
    for n in saved_iterations(args, start, found):
        check_save_target(save, n, kind, args.checkpoint.overwrite_checkpoints, start)


def resume_warnings(args, extra: dict) -> list[str]:
    """One line per data setting that differs from the run that wrote the checkpoint."""
    data = ((extra.get("args") or {}).get("data")) or {}
    out = []
    if data.get("seq_length") not in (None, args.data.seq_length):
        out.append(f"the checkpoint was trained with --seq-length {data['seq_length']}, this "
                   f"run uses --seq-length {args.data.seq_length}")
    for flag, field in (("--tokenizer-type", "tokenizer_type"),
                        ("--tokenizer-model", "tokenizer_model")):
        theirs, ours = data.get(field), getattr(args.data, field)
        if theirs is not None and ours is not None and theirs != ours and not (
                field == "tokenizer_model" and _same_file(theirs, ours)):
            out.append(f"the checkpoint was trained with {flag} {theirs}, this run uses "
                       f"{flag} {ours}")
    schedule = schedule_change(args.training, (extra.get("args") or {}).get("training") or {},
                               int(extra.get("iteration", 0)))
    return out + ([schedule] if schedule else [])


SCHEDULE_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters",
                   "train_iters")


def schedule_change(ours, theirs: dict, start: int) -> str | None:
    """A line when this run's learning rate at `start` differs from the one the checkpoint's
    run would have used there (`theirs`: its recorded training args), saying why when it is
    the usual cause: a larger --train-iters moves the end of the decay, so the rate climbs
    back up (a cosine "re-warm") instead of continuing."""
    recorded = {k: theirs[k] for k in SCHEDULE_FIELDS if k in theirs}
    try:
        old = dataclasses.replace(ours, **recorded)
    except (TypeError, ValueError):  # another megazoo's fields: nothing to compare
        return None
    before, now = learning_rate(start, old), learning_rate(start, ours)
    if math.isclose(before, now, rel_tol=1e-9, abs_tol=1e-15):
        return None
    line = (f"the learning-rate schedule changed: iteration {start + 1} would have used lr "
            f"{before:.3e} in the checkpoint's run, this run uses {now:.3e}")
    if old.train_iters != ours.train_iters and ours.lr_decay_iters is None:
        line += (f" (the {ours.lr_decay_style} decay ends at --train-iters, now {ours.train_iters}"
                 f" instead of {old.train_iters}; pass --lr-decay-iters {old.decay_iters} to "
                 f"continue the old schedule)")
    return line


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
