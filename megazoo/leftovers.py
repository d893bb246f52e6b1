"""Temp files that a killed megazoo process left: found by the pid in their names and removed
once that process is gone (the data index builder's, the default corpus's, the checkpoint
writer's). Below every package that writes such files.
"""
from __future__ import annotations

import os
import re


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_leftovers(folder: str, pattern: str) -> list[str]:
    """Remove the files in `folder` whose names match `pattern` (a regex with a `pid` group:
    a temp file a megazoo process names after itself) and whose process no longer exists on
    this host; return their paths. Anything else, and files of live processes, stay."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = re.fullmatch(pattern, name)
        if match is None or int(match["pid"]) == os.getpid() or pid_alive(int(match["pid"])):
            continue
        path = os.path.join(folder, name)
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass  # gone already, or not ours to remove: leave it
    return removed
