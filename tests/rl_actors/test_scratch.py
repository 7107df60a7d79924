"""Scratch directories (``rl_actors.scratch``): named after their process, removed on exit, and
those of a process that no longer runs (a rank killed mid-snapshot) removed by the next one that
opens one, or by the driver's shutdown; the room check counts the peers that write beside it."""
import os
import shutil
import subprocess
import sys

import pytest

from rl_actors import scratch as scratch_module
from rl_actors.scratch import leftovers, ours, scratch, sweep


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make(root, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(os.path.join(path, "engine"))
    with open(os.path.join(path, "engine", "shard.pt"), "wb") as f:
        f.write(b"\0" * 1024)
    return path


def test_only_directories_of_processes_that_no_longer_run_are_swept(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    gone = [_make(tmp_path, f"rayrl-snapshot-trainer1-pid{dead}-ab12"),
            _make(tmp_path, f"rayrl-restore-critic0-pid{dead}-x_9"), _make(tmp_path, f"rayrl-lora-pid{dead}-q")]
    kept = [_make(tmp_path, f"rayrl-snapshot-trainer0-pid{live}-cd34"),  # a rank snapshotting now
            _make(tmp_path, f"snapshot-trainer1-pid{dead}-zz"),  # not ours
            _make(tmp_path, f"rayrl-notes-{dead}"),  # ours in name, no owner: left alone
            _make(tmp_path, "pymp-xyz")]
    assert sorted(leftovers((str(tmp_path),))) == sorted(gone)
    assert sorted(ours((str(tmp_path),))) == sorted([(p, dead) for p in gone] + [(kept[0], live)])  # live ones too
    assert sweep((str(tmp_path),)) == 3
    assert sorted(os.path.join(tmp_path, n) for n in os.listdir(tmp_path)) == sorted(kept)
    assert sweep((str(tmp_path),)) == 0


def test_a_scratch_directory_is_named_for_its_process_and_removed_even_on_error(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch_module, "scratch_dir", lambda needed: str(tmp_path))
    monkeypatch.setattr(scratch_module, "sweep", lambda roots=None: sweep((str(tmp_path),)))
    leftover = _make(tmp_path, f"rayrl-snapshot-trainer1-pid{_dead_pid()}-ab12")
    with scratch("snapshot-trainer0", 10) as path:
        assert os.path.basename(path).startswith(f"rayrl-snapshot-trainer0-pid{os.getpid()}-")
        assert not os.path.exists(leftover)  # opening one swept the dead process's
        assert leftovers((str(tmp_path),)) == []  # a live process's directory is not a leftover
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError):
        with scratch("restore-trainer0", 10) as path:
            raise RuntimeError("killed mid-restore")
    assert os.listdir(tmp_path) == []


def test_the_room_check_counts_the_peers_writing_beside_it(monkeypatch):
    """Shared memory with room for one rank's 40 MB (and a quarter more) but not for two ranks'."""
    free = 60 * 2 ** 20
    monkeypatch.setattr(scratch_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(0, 0, free))
    monkeypatch.setattr(scratch_module.os.path, "isdir", lambda path: True)
    monkeypatch.setattr(scratch_module.os, "access", lambda path, mode: True)
    chosen = []
    monkeypatch.setattr(scratch_module.tempfile, "mkdtemp", lambda prefix, dir: chosen.append(dir) or dir)
    monkeypatch.setattr(scratch_module.shutil, "rmtree", lambda path, ignore_errors=False: None)
    monkeypatch.setattr(scratch_module, "sweep", lambda roots=None: 0)
    with scratch("snapshot-trainer0", 40 * 2 ** 20, sharers=1):
        pass
    with scratch("snapshot-trainer0", 40 * 2 ** 20, sharers=2):
        pass
    assert chosen[0] == "/dev/shm" and chosen[1] == scratch_module.tempfile.gettempdir()
