"""The disk tier's folder (--nvme-path's `rank{r:05d}`) belongs to one run at a time, and
holds only what the disk store makes.

    claim_folder(root)   # before any shard file is opened (truncated); StoreError if not ours

Two runs given the same --nvme-path would truncate and overwrite each other's optimizer
state (and save it): the first run takes an exclusive `flock` on the folder's `LOCK` file
and keeps it until the process ends (the kernel drops it then, also after a kill -9), and a
second process's claim fails with one line. The lock file also marks the folder as the
store's: a folder that exists without it and holds anything, or that holds files other than
the store's shards, is refused instead of having a user's file of the same name truncated.
One process may claim a folder again (a run that builds its engine anew, the tests): the
claims this process holds are kept by real path in `_HELD`, the process's own open locks.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

LOCK = "megazoo-disk-store.lock"
_SHARD = re.compile(r"shard\d{5}\.bin")
_HELD: dict[str, int] = {}  # real path of a claimed folder -> the locked file's descriptor


def _foreign(root: Path) -> list[str]:
    """Names in `root` the store did not make (all of them when it has no lock file)."""
    names = sorted(os.listdir(root))
    if LOCK not in names:
        return names
    return [n for n in names if n != LOCK and not _SHARD.fullmatch(n)]


def claim_folder(root: str | Path, error=ValueError) -> None:
    """Make `root` this process's disk-store folder, or raise `error` (one line) naming what
    to change: another run holds it, or it holds files the store did not make."""
    root = Path(root)
    key = os.path.realpath(root)
    if key in _HELD:
        return
    root.mkdir(parents=True, exist_ok=True)
    foreign = _foreign(root)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise error(f"disk store path {root} holds files megazoo's disk store did not make "
                    f"({shown}); give --nvme-path an empty folder or one a megazoo run made")
    import fcntl

    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        raise error(f"disk store path {root} is in use by another run (it holds the lock "
                    f"{LOCK}); give each run its own --nvme-path") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"optimizer state of a megazoo run (pid {os.getpid()}); the shard files "
                 "are scratch, made anew by the next run that uses this folder\n".encode())
    _HELD[key] = fd
