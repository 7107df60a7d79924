"""``primitives.files.made_once``: a directory made by one process however many ask at once."""
import os
import time
from pathlib import Path

from primitives.files import made_once


def _make_slowly(path: str, log: str, fail: bool) -> None:
    def write(staging):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # long enough for the others to ask meanwhile
        if fail:
            raise RuntimeError("a writer that fails")
        Path(staging, "done").write_text("whole")

    try:
        made_once(path, write, lambda p: os.path.isfile(os.path.join(p, "done")))
    except RuntimeError:
        return
    assert Path(path, "done").read_text() == "whole"  # every asker that returns finds it whole


def test_made_once_writes_once_however_many_ask_and_a_failed_writer_hands_on(tmp_path):
    """Four processes ask at once: one writes, the others wait and find it made. Where the first to
    write fails, the next to take the lock writes it."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for fail_first in (False, True):
        path, log = str(tmp_path / f"made{fail_first}"), str(tmp_path / f"log{fail_first}")
        procs = [ctx.Process(target=_make_slowly, args=(path, log, fail_first and i == 0)) for i in range(4)]
        procs[0].start()
        time.sleep(0.1)  # the failing one first
        for p in procs[1:]:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        writers = Path(log).read_text().split()
        assert len(writers) == (2 if fail_first else 1) and writers[0] == str(procs[0].pid)
        assert Path(path, "done").read_text() == "whole"
        assert sorted(os.listdir(tmp_path / f"made{fail_first}")) == ["done"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]  # no staging left
