"""User and environment errors as one line: an OSError on a path the user gave, a file that
does not decode, and how every command reports the line (once, also under torchrun).

    with user_path("--save", save):          # an OSError inside becomes a PathError:
        os.makedirs(save, exist_ok=True)     # "--save /x is on a read-only file system: ..."
    text = read_text(path, "--prompt-file")  # bytes that are not UTF-8: one line naming the file
    meta = read_json(path)                   # not UTF-8, not JSON, not an object: likewise
    return report_error(str(exc))            # rank 0 prints "error: ...", exit status 2

A read-only file system, a full disk, a file where a folder is expected or a permission
refused is the user's to fix, so it is a ValueError (`PathError`) whose text names the flag,
the path and what to do, never a traceback. Under torchrun every rank reports the same line:
only rank 0 prints it, and each rank writes it to torchrun's error file
($TORCHELASTIC_ERROR_FILE), so the launcher's failure summary ends with that line as its
root cause instead of "To enable traceback see ...".
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time


class PathError(ValueError):
    """An OSError on a path the user gave, as one line naming it and what to do."""


def _existing_ancestor(path: str) -> str:
    """`path` or its nearest existing parent (the folder a disk check can stat)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _file_in_the_way(path: str) -> str | None:
    """The part of `path` (itself or a parent, spelt as given) that exists and is not a
    folder, if any."""
    path = os.path.normpath(path)
    while path and not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path if os.path.exists(path) and not os.path.isdir(path) else None


def _problem(exc: OSError, target: str, flag: str) -> tuple[str, str]:
    """(what is wrong with `target`, what to do) for one OSError."""
    code = exc.errno
    if code == errno.EROFS:
        return f"{target} is on a read-only file system", f"choose a writable {flag}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({shutil.disk_usage(_existing_ancestor(target)).free / 1e9:.2f} GB free)"
        except OSError:
            free = ""
        return (f"no space left on the disk of {target}{free}",
                f"free some space or choose a {flag} on another disk")
    if code in (errno.EACCES, errno.EPERM):
        return (f"permission denied for {target}",
                f"fix its permissions or choose another {flag}")
    blocker = _file_in_the_way(target) if code in (errno.ENOTDIR, errno.EEXIST) else None
    if blocker is not None:
        return (f"{blocker} is a file where a folder is expected",
                f"move it away or choose another {flag}")
    if code == errno.EISDIR:
        return f"{target} is a folder where a file is expected", f"choose another {flag}"
    if code == errno.ENOENT:
        return f"{target} does not exist", f"check {flag}"
    return f"{exc.strerror or exc} ({target})", f"check {flag}"


def _holds(folder: str, target: str) -> bool:
    folder, target = os.path.abspath(folder), os.path.abspath(target)
    return target == folder or target.startswith(folder.rstrip(os.sep) + os.sep)


def explain(exc: OSError, paths: dict[str, str | os.PathLike]) -> PathError:
    """The one-line PathError for `exc`, naming the flag (of `paths`: flag -> path given)
    whose path holds the file the error is about (the first flag when none does)."""
    given = {flag: os.fspath(p) for flag, p in paths.items() if p is not None}
    target = os.fspath(exc.filename) if exc.filename else None
    holding = [f for f in given if target is not None and _holds(given[f], target)]
    flag = max(holding, key=lambda f: len(os.path.abspath(given[f]))) if holding \
        else next(iter(given))
    path = given[flag]
    subject = target or path
    what, todo = _problem(exc, subject, flag)
    if subject == path and what.startswith(path):  # "--save ck is on a read-only ..."
        return PathError(f"{flag} {what}: {todo}")
    return PathError(f"{flag} {path}: {what}: {todo}")


@contextlib.contextmanager
def user_path(flag: str | dict, path=None):
    """Turn an OSError raised inside into `explain`'s PathError: `user_path("--save", save)`,
    or for several inputs `user_path({"--out": out, "--load": load})`. OSErrors made by
    megazoo itself (a message, no errno) pass as they are."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise
        raise explain(exc, flag if isinstance(flag, dict) else {flag: path}) from None


def read_text(path, what: str = "") -> str:
    """The file's text (UTF-8); one-line ValueError naming it when it cannot be read or does
    not decode. `what` is the flag that named the file ("--prompt-file "), if one did."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        if what:
            raise explain(exc, {what.strip(): path}) from None
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}{path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                         f"at offset {exc.start}): fix or replace the file") from None


def read_json(path, what: str = "", advice: str = "fix or replace the file") -> dict:
    """A JSON object read from `path`; one-line ValueError naming the file (and where it
    breaks) when it is not UTF-8, not JSON, or not an object."""
    text = read_text(path, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}{path} is not valid JSON (line {exc.lineno} column "
                         f"{exc.colno}: {exc.msg}): {advice}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}{path} holds a JSON {type(data).__name__}, not an object: "
                         f"{advice}")
    return data


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
OTHER_RANK_EXIT_DELAY_S = 5.0
"""How long a rank other than 0 waits before it records and exits with a reported error: all
ranks meet the same bad input at once, and rank 0, which prints the line, must exit first
and be torchrun's root cause (the first failure by its error file's timestamp, in whole
seconds: a file another rank wrote a second earlier would win)."""


def report_error(message: str, code: int = 2, prefix: str = "error: ") -> int:
    """Print `prefix + message` as one line on stderr (on rank 0 only when a launcher started
    several ranks), record it in torchrun's error file, and return `code` (the exit status)."""
    line = prefix + " ".join(str(message).split())
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        print(line, file=sys.stderr, flush=True)
    else:  # torchrun stops every rank once one exits: rank 0 first, or its line could be cut
        time.sleep(OTHER_RANK_EXIT_DELAY_S)  # off before it is printed, or lose the root cause
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        record = {"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(record, f)
        except OSError:
            pass  # the launcher's summary is a convenience; the line was printed
    return code
