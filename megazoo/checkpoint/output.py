"""Where a checkpoint may be written, and the temp-folder + rename protocol that writes it.

**Nothing of the user's is deleted.** `check_output_dir` runs before anything is written:

- an `out` that does not exist, or is an empty folder, is fine;
- an `out` that is, contains, or lies inside one of the inputs is refused (even with
  overwrite), comparing real paths and taking an input also for the checkpoint folder it
  resolves to (`resolve.input_folders`): `--load SAVE --out SAVE/iter_20` is refused when
  SAVE's `latest` names 20;
- any other non-empty `out` is refused unless `overwrite`; with it, only a folder that is a
  checkpoint of the kind being written (its marker file present) and holds nothing but that
  kind's files is replaced; anything else in it makes it a refusal that names the files.

**Atomic publish.** A checkpoint is written into `temp_dir(path)` (holding an `OWNER_FILE`
with the writer's host and pid), then `publish` renames an existing `path` aside
(`OLD_SUFFIX`), renames the new one in and deletes the old one: a crash before the rename
leaves any previous `path` untouched. A temp folder left by a killed writer is removed by the
next write only when its owner file names this host and a process that no longer exists.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
import sys
import time

from ..leftovers import pid_alive, remove_leftovers  # noqa: F401 (remove_leftovers: re-exported)
from .resolve import OLD_SUFFIX, input_folders

OWNER_FILE = ".megazoo-writer.json"
TEMP_SUFFIX = ".megazoo-tmp"

# kind -> (marker file that makes a folder a checkpoint of that kind, file patterns it owns)
KINDS = {
    "megazoo": ("megazoo.json", ("megazoo.json", "model-pp*-tp*.safetensors", "compression",
                                 OWNER_FILE)),
    "hf": ("config.json", ("config.json", "generation_config.json", "model.safetensors",
                           "model-*-of-*.safetensors", "model.safetensors.index.json", OWNER_FILE)),
    # DeepSpeedEngine.save: DeepSpeed's files (its shards under zero/, its scripts) + ours
    "deepspeed": ("megazoo.json", ("megazoo.json", "latest", "zero", "zero_to_fp32.py",
                                   "zero_to_torch.py")),
}


FAULT_ENV = "MEGAZOO_FAULT"


def fault_point(point: str, path: str) -> None:
    """For fault-injection tests: when $MEGAZOO_FAULT is "`point`:SUBSTRING" and SUBSTRING is
    in `path`, say so on stderr and sleep, so a test can kill the process exactly here."""
    want, _, where = os.environ.get(FAULT_ENV, "").partition(":")
    if want == point and where and where in path:
        print(f"megazoo fault point {point} reached for {path}", file=sys.stderr, flush=True)
        time.sleep(3600)


def clean_path(path: str | os.PathLike) -> str:
    """The folder as a normalised string (no trailing separator)."""
    return os.path.normpath(os.fspath(path))


def temp_dir(path: str) -> str:
    """The sibling folder a checkpoint of `path` is written into before the rename."""
    return clean_path(path) + TEMP_SUFFIX


def _is_within(inner: str, outer: str) -> bool:
    """True if `inner` is `outer` or lies inside it (both resolved through symlinks)."""
    inner, outer = os.path.realpath(inner), os.path.realpath(outer)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _check_inputs(out: str, inputs) -> None:
    """ValueError if `out` is, contains, or lies inside one of `inputs` (see the module doc)."""
    for source in inputs:
        folders = input_folders(source)
        hit = next((f for f in folders if _is_within(f, out)), None)
        if hit is None and len(folders) > 1 and _is_within(out, folders[-1]):
            hit = folders[-1]  # inside the checkpoint folder the input resolves to
        if hit is not None:
            means = "" if hit == os.path.realpath(os.fspath(source)) else \
                f" ({hit}, the checkpoint {os.fspath(source)} resolves to)"
            raise ValueError(f"--out {out} is or contains the input {os.fspath(source)}{means}: "
                             f"writing it would replace what is being read; choose another --out")


def check_output_dir(out, *, kind: str, overwrite: bool = False, inputs=()) -> None:
    """ValueError (one line, saying what to change) unless writing `out` loses nothing (the
    rules are in the module docstring). `kind` is a key of `KINDS`; `inputs` are the folders
    the writer reads."""
    out = clean_path(out)
    _check_inputs(out, inputs)
    if not os.path.lexists(out):
        return
    if os.path.islink(out):  # publish would replace the link, not the folder it names
        raise ValueError(f"--out {out} is a symbolic link (to {os.readlink(out)}): give the "
                         f"folder itself as --out, or remove the link")
    if not os.path.isdir(out):
        raise ValueError(f"--out {out} exists and is not a folder; choose another --out")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    if not overwrite:
        raise ValueError(f"{out} exists and is not empty; choose another --out or pass "
                         f"--overwrite")
    marker = KINDS[kind][0]
    if marker not in entries:
        raise ValueError(f"--overwrite replaces only a {kind} checkpoint folder ({marker} "
                         f"inside); {out} is not one, so it is kept: choose another --out")
    check_only_ours(out, kind)


def check_only_ours(out: str, kind: str, names: tuple[str, str] = ("--out", "--overwrite")) -> None:
    """ValueError naming the entries of the folder `out` that a checkpoint of `kind` does not
    hold (what replacing the folder would delete that is not the writer's own). `names`: how
    the message calls the output and the flag that replaces it."""
    what, flag = names
    patterns = KINDS[kind][1]
    foreign = [e for e in sorted(os.listdir(out))
               if not any(fnmatch.fnmatch(e, p) for p in patterns)]
    if foreign:
        raise ValueError(f"{flag} would delete {', '.join(foreign[:3])}"
                         f"{' ...' if len(foreign) > 3 else ''} in {out}, which a {kind} "
                         f"checkpoint does not hold: move them away or choose another {what}")


def _clear_stale_temp(tmp: str) -> None:
    """Remove `tmp` if a killed megazoo writer on this host left it; else ValueError naming it."""
    try:
        with open(os.path.join(tmp, OWNER_FILE)) as f:
            owner = json.load(f)
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{tmp} is in the way and was not written by this megazoo (no readable "
                         f"{OWNER_FILE}): remove or rename it") from None
    if host != socket.gethostname():
        raise ValueError(f"{tmp} was left by a writer on host {host} (pid {pid}); if that run is "
                         f"over, remove the folder")
    if pid != os.getpid() and pid_alive(pid):
        raise ValueError(f"{tmp} is being written by process {pid} now: wait for it, or stop it "
                         f"and run again")
    shutil.rmtree(tmp)
    print(f"removed {tmp}, the unfinished output of an earlier run (pid {pid}) that was killed",
          file=sys.stderr)


def fresh_temp_dir(path: str) -> str:
    """Create the temp folder of `path`, empty, with its owner file (one process only)."""
    tmp = temp_dir(path)
    old = clean_path(path) + OLD_SUFFIX
    if os.path.lexists(old):
        raise ValueError(f"an interrupted save left the previous checkpoint at {old}: rename it "
                         f"back to {clean_path(path)} (or delete it), then run again")
    if os.path.lexists(tmp):
        _clear_stale_temp(tmp)
    try:
        os.makedirs(tmp)
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"cannot create the output folder {clean_path(path)}: "
                         f"{exc.strerror or exc}") from None
    return tmp


def publish(path: str) -> None:
    """Move the finished temp folder to `path`, replacing an approved existing checkpoint."""
    path = clean_path(path)
    tmp, old = temp_dir(path), path + OLD_SUFFIX
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    os.remove(os.path.join(path, OWNER_FILE))
    if os.path.lexists(old):
        shutil.rmtree(old)


def discard(path: str) -> None:
    """Remove the temp folder of `path` after a failed write (best effort)."""
    shutil.rmtree(temp_dir(path), ignore_errors=True)
