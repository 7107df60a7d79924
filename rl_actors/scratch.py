"""Scratch directories that a snapshot, a restore or a vLLM adapter load pass their files
through: shared memory (``/dev/shm``) where it has room, so that nothing touches a disk.

Each is named ``rayrl-<kind>-pid<pid>-...`` after the process that made it. A process killed
while one is open (a rank killed mid-snapshot, or one its group's rebuild kills) cannot remove
it; the next process that opens one on that machine removes every ``rayrl-`` directory whose
process no longer runs (``sweep``), and the driver sweeps when a cluster shuts down, so each
leftover lives only until the next snapshot or the run's end.

A library that leaves files in the temporary directory for as long as its process lives (vLLM's
rendezvous file) writes them in a directory of the process's own (``process_tempdir``), swept alike.

A snapshot's files travel as ``{relative path: uint8 array}`` (``read_tree`` / ``write_tree``).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, Optional

PREFIX = "rayrl-"
SHM = "/dev/shm"
_OWNER = re.compile(r"^rayrl-[\w.-]*?-pid(\d+)-")


def scratch_dir(needed: int = 0) -> str:
    """``/dev/shm`` where the machine has it with room for ``needed`` bytes and a quarter more
    (a container's is often 64 MB), else the temporary directory."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= needed * 1.25:
        return SHM
    return tempfile.gettempdir()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def ours(roots: Optional[tuple] = None) -> list:
    """``(path, pid)`` of every scratch directory of ours under ``roots`` (shared memory and the
    temporary directory), whatever its process."""
    out = []
    for root in roots or (SHM, tempfile.gettempdir()):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        out += [(os.path.join(root, n), int(m.group(1))) for n in names if (m := _OWNER.match(n))]
    return out


def leftovers(roots: Optional[tuple] = None) -> list:
    """Our scratch directories under ``roots`` whose process no longer runs."""
    return [path for path, pid in ours(roots) if not _running(pid)]


def sweep(roots: Optional[tuple] = None) -> int:
    """Remove the scratch directories of processes that no longer run; how many were removed."""
    gone = leftovers(roots)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


@contextmanager
def scratch(kind: str, needed: int, sharers: int = 1) -> Iterator[str]:
    """A new scratch directory for about ``needed`` bytes, removed on exit. ``sharers``: how many
    processes may fill the same machine's shared memory at once (a group's ranks snapshot
    together), so one rank's room check counts its peers' writes too."""
    sweep()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-pid{os.getpid()}-", dir=scratch_dir(needed * max(1, sharers)))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read_tree(directory: str) -> dict:
    """Every file under ``directory`` as ``{relative path: uint8 array}`` (arrays, not bytes: Ray
    writes an array into its object store without pickling a copy of it)."""
    import numpy as np

    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, directory)] = np.fromfile(full, dtype=np.uint8)
    return files


def write_tree(directory: str, files: dict) -> None:
    """The inverse of ``read_tree``: ``{relative path: uint8 array}`` written under ``directory``."""
    for rel, data in files.items():
        full = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        data.tofile(full)


def snapshot_bytes(part) -> int:
    """The bytes a snapshot part holds: its files and tensors, in nested dicts."""
    import torch

    if isinstance(part, (bytes, bytearray)):
        return len(part)
    if hasattr(part, "nbytes") and not isinstance(part, torch.Tensor):  # an array
        return int(part.nbytes)
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    if isinstance(part, dict):
        return sum(snapshot_bytes(v) for v in part.values())
    return 0


@contextmanager
def process_tempdir(kind: str) -> Iterator[str]:
    """While the block runs, the temporary directory (``tempfile`` and ``TMPDIR``, which child processes
    read) is a new ``rayrl-<kind>-pid<pid>-...`` directory of this process. It stays after the block, as
    what was made there may be in use for the process's life (vLLM's engine keeps its rendezvous file, a
    ``torch.distributed`` FileStore, and removes it only if shut down, which a killed actor never is), and
    ``sweep`` removes it once the process no longer runs."""
    sweep()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-pid{os.getpid()}-", dir=tempfile.gettempdir())
    before, before_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = before
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env
