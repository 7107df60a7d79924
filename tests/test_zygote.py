"""The test run's forked workers (``tests/zygote.py``): a worker the zygote forks gets what the
raylet gave the process it started (arguments, environment, directory, streams), that process's
exit and signals are the child's, and anything the zygote cannot stand in for starts as usual.
A stand-in ``default_worker.py`` plays Ray's worker script; the zygote preloads numpy only."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.zygote import SOCKET_ENV, TITLE_ROOM, Zygote

WORKER = r'''
import json, os, signal, sys, time
import numpy
signal.signal(signal.SIGTERM, lambda *a: (print("terminated", flush=True), sys.exit(7)))
print("to stderr", file=sys.stderr, flush=True)
out = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
       "mine": os.environ.get("MINE"), "socket": os.environ.get("RAYRL_ZYGOTE_SOCKET"),
       "draw": float(numpy.random.random()), "cmdline": len(open("/proc/self/cmdline", "rb").read()),
       "preloaded": "numpy" in sys.modules and "torch" not in sys.modules}
out["stdin"] = sys.stdin.readline().strip()
print(json.dumps(out), flush=True)
mode = sys.argv[1]
if mode == "sleep":
    time.sleep(60)
sys.exit(int(mode))
'''


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote({**os.environ, "MINE": "zygote's"}, preload=("numpy",))
    assert z.ready(60), open(z.log).read()
    yield z
    z.stop()


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "default_worker.py"
    path.write_text(WORKER)
    return str(path)


def _run(zygote, args, env=None, **kwargs):
    env = {**os.environ, **zygote.env, "MINE": "the raylet's", **(env or {})}
    proc = subprocess.Popen([zygote.executable, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)
    proc.stdin.write("from the raylet\n")
    proc.stdin.flush()
    return proc


def _first_line(proc) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_worker_is_forked_with_the_raylets_arguments_environment_directory_and_exit(zygote, worker, tmp_path):
    proc = _run(zygote, [worker, "3", "--flag=x"], cwd=str(tmp_path))
    seen = _first_line(proc)
    assert proc.wait(30) == 3  # its exit is the starter's
    assert seen["ppid"] == zygote.pid and seen["pid"] != proc.pid  # forked by the zygote
    assert seen["argv"] == [worker, "3", "--flag=x"]
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == os.path.dirname(worker)
    assert seen["mine"] == "the raylet's"  # the starter's environment, not the zygote's
    assert seen["socket"] is None  # the zygote's address, which the starter had, is not passed on
    assert seen["stdin"] == "from the raylet" and proc.stderr.read() == "to stderr\n"  # its three streams
    assert seen["preloaded"]
    assert seen["cmdline"] >= TITLE_ROOM  # room for Ray's process titles


def test_each_child_draws_its_own_numpy_numbers(zygote, worker):
    draws = []
    for _ in range(2):
        proc = _run(zygote, [worker, "0"])
        draws.append(_first_line(proc)["draw"])
        assert proc.wait(30) == 0
    assert draws[0] != draws[1]


def test_a_child_killed_ends_its_starter_with_the_same_signal(zygote, worker):
    proc = _run(zygote, [worker, "sleep"])
    child = _first_line(proc)["pid"]
    os.kill(child, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def test_a_signal_to_the_starter_reaches_the_child(zygote, worker):
    proc = _run(zygote, [worker, "sleep"])
    _first_line(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "terminated"
    assert proc.wait(30) == 7


def test_a_starter_killed_outright_takes_its_child(zygote, worker):
    proc = _run(zygote, [worker, "sleep"])
    child = _first_line(proc)["pid"]
    proc.kill()
    proc.wait(30)
    assert _ends(child)


def _ends(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within_s``."""
    deadline = time.time() + within_s
    while time.time() < deadline and _state(pid) not in ("gone", "Z"):
        time.sleep(0.05)
    return _state(pid) in ("gone", "Z")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("variable", ["PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE"])
def test_a_worker_whose_import_variables_differ_starts_as_usual(zygote, worker, variable):
    proc = _run(zygote, [worker, "0"], env={variable: "differs"})
    seen = _first_line(proc)
    assert proc.wait(30) == 0
    assert seen["pid"] == proc.pid and seen["ppid"] == os.getpid()  # the real Python, in the starter's place
    assert any("not forked" in line and variable in line for line in zygote.lines())


@pytest.mark.parametrize("sent", ["nothing", "garbage", "a refused request", "a request"])
def test_a_client_that_vanishes_or_garbles_costs_its_request_alone(zygote, worker, sent):
    """The zygote serves the next worker after a client that left at once (as the raylet's kill of a
    starting worker does), sent garbage, or sent a whole request and vanished before the reply (the
    zygote's reply then meets a closed socket; a forked child follows its vanished client out)."""
    import array
    import socket

    env = {**os.environ, "MINE": "x"} if sent == "a request" else {}
    request_sent = {"nothing": b"", "garbage": b"not json\n"}.get(sent) or (
        json.dumps({"argv": ["python", worker, "0"], "env": env, "cwd": "/"}).encode() + b"\n")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(zygote.socket)
    if request_sent:
        sock.sendmsg([request_sent], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    sock.close()
    proc = _run(zygote, [worker, "0"])  # queued behind the bad one: a zygote it killed would not fork this
    assert _first_line(proc)["ppid"] == zygote.pid and proc.wait(30) == 0


def test_the_zygote_leaves_with_the_test_run(tmp_path):
    """A test run that dies without stopping its zygote does not leave it behind."""
    from tests.conftest import ROOT

    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); from tests.zygote import Zygote; "
              "z = Zygote(dict(os.environ), preload=('json',)); assert z.ready(60); print(z.pid, z.dir)")
    done = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, timeout=120)
    pid, left = done.stdout.split()
    assert _ends(int(pid))
    assert not os.path.exists(left)  # nor its socket, log and shim


def test_anything_but_a_worker_runs_as_asked(zygote):
    done = subprocess.run([zygote.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(4)", "a"],
                          env={**os.environ, **zygote.env}, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout.strip()) == (4, "['a']")


def test_without_a_zygote_a_worker_starts_as_usual(zygote, worker):
    proc = _run(zygote, [worker, "5"], env={SOCKET_ENV: "/nonexistent/sock"})
    seen = _first_line(proc)
    assert proc.wait(30) == 5 and seen["pid"] == proc.pid


def test_without_ray_hides_ray_and_puts_back_what_was_there(monkeypatch):
    from tests.zygote import without_ray

    import_ray = "import ray.util"
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    with without_ray(), pytest.raises(ImportError):
        exec(import_ray)
    assert "ray" not in sys.modules
    stand_in = object()
    monkeypatch.setitem(sys.modules, "ray", stand_in)
    with without_ray():
        assert sys.modules["ray"] is None
    assert sys.modules["ray"] is stand_in
    monkeypatch.delitem(sys.modules, "ray")
    with without_ray():
        with pytest.raises(KeyError), without_ray():  # nested, left by an exception: the outer block's None stays
            raise KeyError("inside")
        assert sys.modules["ray"] is None
        del sys.modules["ray"]  # the body removed it: nothing to put back, no error
    assert "ray" not in sys.modules


def test_vllms_import_leaves_the_environment_and_a_missing_module_is_skipped(monkeypatch, capsys):
    """What vLLM's import sets in ``os.environ`` is not handed to forked workers; a vLLM that does not import
    leaves the zygote serving without it (named in its log)."""
    import builtins

    from tests import zygote as zygote_module

    real_import = builtins.__import__

    def import_setting(name, *args, **kwargs):
        if not name.startswith("vllm"):  # DeepSpeed's accelerator check, where DeepSpeed is imported
            return real_import(name, *args, **kwargs)
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        if name == "vllm.missing":
            raise ModuleNotFoundError("No module named 'vllm.missing'")

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    builtins.__import__ = import_setting
    try:
        added = zygote_module._preload(("vllm.entrypoints.llm", "vllm.missing"))
        left = "TORCHINDUCTOR_COMPILE_THREADS" in os.environ
    finally:
        builtins.__import__ = real_import
    assert added == {} and not left
    assert "zygote: vllm.missing not preloaded (ModuleNotFoundError" in capsys.readouterr().out


class Probe:
    def info(self) -> tuple:
        return os.getpid(), os.getppid(), os.environ.get("OMP_NUM_THREADS"), {"torch", "vllm"} <= set(sys.modules)


def test_the_runs_ray_forks_its_actors_from_the_zygote(ray_local):
    """On the run's own Ray an actor's process is a child of the zygote with the libraries already
    imported (vLLM's engine among them, Ray not), the variables Ray gives its workers, and Ray's process
    title (the tests find actors by it)."""
    from tests import zygote as run_zygote
    from tests.chaos import actor_pids

    if os.environ.get("RAYRL_TEST_FORK_WORKERS") == "0":
        pytest.skip("RAYRL_TEST_FORK_WORKERS=0: workers start as usual")
    actor = ray_local.remote(Probe).options(num_cpus=0).remote()
    try:
        pid, ppid, threads, preloaded = ray_local.get(actor.info.remote(), timeout=60)
        assert ppid in [z.pid for z in run_zygote.started()] and preloaded  # vLLM's engine too
        for z in run_zygote.started():  # but not Ray (vLLM imports it where it can): each worker imports its own
            with open(f"/proc/{z.pid}/maps") as f:
                assert "_raylet" not in f.read()
        assert threads == "1"
        assert pid in actor_pids("Probe")
    finally:
        ray_local.kill(actor)


@pytest.fixture
def light_zygotes(monkeypatch):
    """``tests.zygote.zygote`` starting zygotes that preload json alone, none started yet; stopped after."""
    from tests import zygote as run_zygote

    class Light(Zygote):
        def __init__(self, env):
            super().__init__(env, preload=("json",))

    monkeypatch.setattr(run_zygote, "Zygote", Light)
    monkeypatch.setattr(run_zygote, "_ZYGOTES", {})
    monkeypatch.delenv("RAYRL_TEST_FORK_WORKERS", raising=False)
    yield run_zygote
    run_zygote.stop()


def test_a_block_inside_another_runs_the_real_python(light_zygotes):
    """Blocks nested with different variables (a simulated node added inside the cluster's start): the
    inner zygote and its shim run the real Python, not the outer shim (which would start itself over
    and over), and the real one is back after."""
    real = sys.executable
    with light_zygotes.ray_workers_forked({"PYTHONPATH": "a"}):
        with light_zygotes.ray_workers_forked({"PYTHONPATH": "a", "LD_LIBRARY_PATH": "/elsewhere"}):
            done = subprocess.run([sys.executable, "-c", "import sys; print(sys.executable)"], capture_output=True,
                                  text=True, timeout=30)
            assert len(light_zygotes.started()) == 2
    assert done.stdout.strip() == real == sys.executable == light_zygotes.PYTHON
    assert all(z.python == real for z in light_zygotes.started())


def test_one_zygote_per_set_of_import_variables(light_zygotes, monkeypatch):
    """A raylet started after this process changed a variable the preloads read gets a zygote of its own
    (its workers would all be refused by the first); the same variables share one."""
    run_zygote = light_zygotes
    first = run_zygote.zygote({"PYTHONPATH": "a", "MINE": "1"})
    assert run_zygote.zygote({"PYTHONPATH": "a", "MINE": "0"}) is first  # not read at import
    other = run_zygote.zygote({"PYTHONPATH": "a", "LD_LIBRARY_PATH": "/elsewhere"})
    assert other is not first and other.pid != first.pid
    assert run_zygote.started() == [first, other]
    monkeypatch.setenv("RAYRL_TEST_FORK_WORKERS", "0")
    assert run_zygote.zygote({"PYTHONPATH": "a"}) is None
