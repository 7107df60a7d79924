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
from tests.conftest import ROOT


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


def test_a_process_tempdir_holds_what_a_library_leaves_and_goes_with_its_process(tmp_path):
    """A process (a vLLM generator, in small) points the temporary directory at one of its own while a library
    starts, for its children too, and back after; what was left there stays while the process lives, and
    the first sweep after it has gone removes it."""
    child = (
        "import os, subprocess, sys, tempfile\n"
        "from rl_actors.scratch import leftovers, process_tempdir\n"
        "root = tempfile.gettempdir()\n"
        "with process_tempdir('vllm') as path:\n"
        "    fd, left = tempfile.mkstemp(prefix='vllm_dist_')\n"
        "    grandchild = subprocess.run([sys.executable, '-c', 'import tempfile; print(tempfile.gettempdir())'],\n"
        "                                capture_output=True, text=True).stdout.strip()\n"
        "assert os.path.dirname(left) == path == grandchild, (left, path, grandchild)\n"
        "assert tempfile.gettempdir() == root and os.environ['TMPDIR'] == root\n"
        "assert os.path.basename(path).startswith(f'rayrl-vllm-pid{os.getpid()}-') and os.path.isfile(left)\n"
        "assert leftovers((root,)) == []  # this process runs: not a leftover\n"
        "print(path)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = proc.stdout.strip().splitlines()[-1]
    assert os.path.dirname(path) == str(tmp_path) and [n[:10] for n in os.listdir(path)] == ["vllm_dist_"]
    assert sweep((str(tmp_path),)) == 1 and os.listdir(tmp_path) == []
