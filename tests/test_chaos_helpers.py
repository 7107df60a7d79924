"""``tests/chaos.py``'s process finder: the fault and chaos tests kill and stop the actors it finds."""
import os
import signal
import subprocess
import sys

import psutil

from tests.chaos import actor_pids


def _titled(pid: int, title: str, timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` shows ``title``: ``Popen`` returns once the exec has begun, and the kernel
    sets the new program's arguments a moment later (its cmdline reads empty until then), a moment a loaded
    machine can stretch: this tier runs at SCHED_IDLE beside the Ray tests, and once the finder read nothing
    there (the likely cause; the orphan is waited for too, so that not finding it is not vacuous)."""
    import time

    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).cmdline()[:1] != [title]:
        assert time.monotonic() < deadline, f"process {pid} never showed its title {title!r}"
        time.sleep(0.05)


def test_the_actor_finder_finds_this_runs_actors_alone(tmp_path):
    """A process titled as an actor that descends from this pytest is found; one outside it, titled
    the same (another Ray's actor on the machine: a ``make run`` beside the tests), never is."""
    title = f"ray::ProbeWorker{os.getpid()}"
    mine = subprocess.Popen([title, "60"], executable="/bin/sleep")
    pid_file = tmp_path / "pid"
    outside = ("import subprocess, sys; p = subprocess.Popen([sys.argv[1], '60'], executable='/bin/sleep', "
               "start_new_session=True); open(sys.argv[2], 'w').write(str(p.pid))")
    subprocess.run([sys.executable, "-c", outside, title, str(pid_file)], check=True, timeout=60)
    orphan = int(pid_file.read_text())  # its parent has exited: no longer under this process
    try:
        _titled(mine.pid, title)
        _titled(orphan, title)
        assert psutil.pid_exists(orphan) and os.getpid() not in [p.pid for p in psutil.Process(orphan).parents()]
        assert actor_pids(title[len("ray::"):]) == [mine.pid]
        assert actor_pids(title[len("ray::"):], since=psutil.Process(mine.pid).create_time() + 1) == []
    finally:
        mine.kill()
        os.kill(orphan, signal.SIGKILL)
        mine.wait()


def test_a_watch_among_given_processes_reads_their_titles_alone_and_catches_a_short_call(monkeypatch):
    """``signal_when`` with ``among`` (the fault tests': the cluster's own actors) reads only those processes'
    titles, never a listing of the machine's, and so catches a call of 2 ms that comes every 20 ms (a
    reference worker scoring the tiny model's rows) within its first few calls."""
    import tests.chaos as chaos

    cls = f"ShortCall{os.getpid()}"
    child = ("import setproctitle, sys, time\n"
             "while True:\n"
             "    setproctitle.setproctitle(f'ray::{sys.argv[1]}.score')\n"
             "    time.sleep(0.002)\n"
             "    setproctitle.setproctitle(f'ray::{sys.argv[1]}')\n"
             "    time.sleep(0.018)\n")
    proc = subprocess.Popen([sys.executable, "-c", child, cls])
    try:
        monkeypatch.setattr(chaos, "actor_pids", lambda *a, **k: 1 / 0)  # a listing: the watch dies, nothing sent
        done = chaos.signal_when(cls, "score", signal.SIGKILL, timeout_s=10.0, among={proc.pid})
        assert proc.wait(timeout=10) == -signal.SIGKILL and done["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
