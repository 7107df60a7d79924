"""Files written whole or not at all: a directory (``atomic_directory``) or a text file
(``atomic_file``) is written beside its destination and renamed into place, so a crash leaves
the old one or the new one, never half of one. Below the model, the data and the checkpoints,
which all write through it."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def atomic_directory(path: str, write: Callable[[str], None]) -> str:
    """Run ``write(tmp_dir)`` and move ``tmp_dir`` to ``path`` only if it succeeds."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        write(tmp)
        old = None
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
            os.rename(path, os.path.join(old, "ckpt"))
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def made_once(path: str, write: Callable[[str], None], made: Callable[[str], bool]) -> str:
    """``path`` written (``atomic_directory``) by one process however many ask for it at once: each takes
    an exclusive lock on a sibling file (``.<name>.lock``), and only one that finds ``made(path)`` false
    writes it; the others wait for the lock and find it made. Without the lock two writers would both
    write, and the second's swap would leave ``path`` missing for a moment to a reader of the first's.
    POSIX (``fcntl``); the lock goes with its process."""
    import fcntl

    if made(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{os.path.basename(path)}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not made(path):
            atomic_directory(path, write)
    return path


def atomic_file(path: str, write: Callable) -> str:
    """Run ``write(f)`` on a temporary sibling text file and rename it to ``path`` only if it
    succeeds: a reader sees the old file or the new one, never half of one."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
