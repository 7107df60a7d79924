"""The Python sandbox (architecture section 8, invariant 8): escape attempts are refused and leave no
trace on the host; ordinary code still runs.

Every test runs twice: under bubblewrap (namespaces + seccomp + the in-process layer), and with
the in-process layer alone (rlimits + audit hook, as ``allow_unisolated=True`` runs where no
namespaces are allowed), so each layer is shown to refuse on its own. The bubblewrap variant is
skipped only where bubblewrap cannot create namespaces; it runs on the CI machine.
"""
import ast
import functools
import os
import resource
import socket
import time
import uuid
from pathlib import Path

import pytest

from primitives.env import sandbox
from primitives.env.sandbox import SandboxUnavailable, run_python_sandboxed
from primitives.env.tools import ToolCall, create_tool_executor, python_tool

REPO = Path(__file__).resolve().parents[2]
ESCAPED = "ESC" + "APED"  # printed by code that got out; spelled apart in the code so tracebacks don't echo it
SAY_ESCAPED = "print('ESC' + 'APED', flush=True)"

pytestmark = pytest.mark.filterwarnings("ignore:model-written code runs WITHOUT OS isolation")


@pytest.fixture(params=["bwrap", "unisolated"])
def run(request, monkeypatch):
    """``run(code, **kwargs) -> (ok, output)`` in one of the two modes."""
    if request.param == "bwrap":
        bwrap, why = sandbox._probe_bwrap()
        if bwrap is None:
            pytest.skip(f"bubblewrap cannot create namespaces on this machine: {why}")
        return functools.partial(run_python_sandboxed, allow_unisolated=False)
    monkeypatch.setattr(sandbox, "_probe_bwrap", lambda: (None, "namespaces switched off by the test"))
    return functools.partial(run_python_sandboxed, allow_unisolated=True)


def _unique(name: str) -> str:
    return f"rayrl-escape-{name}-{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- ordinary code works

def test_prints_math_and_standard_library(run):
    ok, out = run("import json, re, math, itertools, collections, fractions, decimal, statistics\n"
                  "print(sum(range(10)), math.factorial(10), fractions.Fraction(1, 3) + fractions.Fraction(1, 6))\n"
                  "print(json.dumps({'a': [1, 2]}), re.findall(r'\\d+', 'a1b22'), statistics.mean([1, 2, 4]))\n"
                  "print(collections.Counter('abca')['a'], list(itertools.accumulate([1, 2, 3])), "
                  "decimal.Decimal('0.1') + decimal.Decimal('0.2'))\n"
                  "print('héllo ✓')")
    assert ok, out
    assert out.splitlines() == ["45 3628800 1/2", '{"a": [1, 2]} [\'1\', \'22\'] 2.3333333333333335',
                                "2 [1, 3, 6] 0.3", "héllo ✓"]


def test_files_in_the_scratch_directory(run):
    ok, out = run("import os, pathlib, shutil, tempfile\n"
                  "open('a.txt', 'w').write('one')\n"
                  "pathlib.Path('d/e').mkdir(parents=True)\n"
                  "pathlib.Path('d/e/b.txt').write_text('two')\n"
                  "os.rename('a.txt', 'd/a.txt')\n"
                  "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
                  "    f.write('three')\n"
                  "print(open('d/a.txt').read(), pathlib.Path('d/e/b.txt').read_text(), open(f.name).read())\n"
                  "shutil.rmtree('d'); os.remove(f.name)\n"
                  "print(os.listdir('.'))")
    assert ok, out
    assert out.splitlines() == ["one two three", "[]"]


def test_errors_come_back_as_tracebacks(run):
    ok, out = run("x = 1\ndef f(:\n    pass")
    assert not ok and "SyntaxError" in out and 'File "<code>", line 2' in out
    ok, out = run("print('before')\ny = 1 / 0")
    assert not ok
    assert out.splitlines()[0] == "before"  # output printed before the error comes first
    assert 'File "<code>", line 2' in out and "y = 1 / 0" in out and out.endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in out  # the prelude's frame is left out
    assert run("import sys; sys.exit(0)") == (True, "")
    assert run("exit(3)")[0] is False
    ok, out = run("print(input())")
    assert not ok and "EOFError" in out  # stdin is empty, never a hang


def test_asyncio_runs(run):
    ok, out = run("import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 7\nprint(asyncio.run(f()))")
    assert (ok, out) == (True, "7")


# ----------------------------------------------------------------------------- file system


@pytest.mark.parametrize("where", ["tmp", "checkout", "home"])
@pytest.mark.parametrize("how", ["open", "os.open", "mkdir", "rename", "symlink"])
def test_writes_outside_the_scratch_directory_are_refused(run, where, how):
    target = {"tmp": Path("/tmp"), "checkout": REPO, "home": Path.home()}[where] / _unique(where)
    attempt = {
        "open": f"open({str(target)!r}, 'w').write('x')",
        "os.open": f"import os; os.write(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY), b'x')",
        "mkdir": f"import os; os.mkdir({str(target)!r})",
        "rename": f"import os; open('f', 'w').write('x'); os.rename('f', {str(target)!r})",
        "symlink": f"import os; os.symlink({str(target)!r}, 'link'); open('link', 'w').write('x')",
    }[how]
    try:
        ok, out = run(attempt + "\n" + SAY_ESCAPED)
        assert not ok and ESCAPED not in out
        assert not target.exists() and not target.is_symlink()
    finally:
        if target.is_dir():
            target.rmdir()
        elif target.exists():
            target.unlink()


@pytest.fixture
def secret_file(tmp_path):
    secret = "TOP-SECRET-" + uuid.uuid4().hex
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    return path, secret


@pytest.mark.parametrize("how", ["open", "os.open", "symlink", "dotdot"])
def test_host_files_are_unreadable(run, secret_file, how):
    path, secret = secret_file
    attempt = {
        "open": f"print(open({str(path)!r}).read())",
        "os.open": f"import os; print(os.read(os.open({str(path)!r}, os.O_RDONLY), 100))",
        "symlink": f"import os; os.symlink({str(path)!r}, 's'); print(open('s').read())",
        "dotdot": f"print(open('../../../../../../..' + {str(path)!r}).read())",
    }[how]
    ok, out = run(attempt)
    assert not ok and secret not in out


@pytest.mark.parametrize("path, content", [("/etc/shadow", "root:"), ("/etc/passwd", "root:x:0"),
                                           (str(REPO / "pyproject.toml"), 'name = "rayrl"'),
                                           (str(REPO / "primitives" / "tools.py"), "def safe_calculate")])
def test_system_and_project_files_are_unreadable(run, path, content):
    ok, out = run(f"print(open({path!r}).read())")
    assert not ok and content not in out


@pytest.mark.parametrize("directory", ["home", "checkout", "root of the file system"])
def test_host_directories_cannot_be_listed(run, directory):
    target = {"home": Path.home(), "checkout": REPO, "root of the file system": Path("/")}[directory]
    names = [repr(p.name) for p in target.iterdir()]  # as a printed list shows them
    for listing in ["import os; print(os.listdir({!r}))", "import os; print([e.name for e in os.scandir({!r})])",
                    "import glob; print(glob.glob({!r} + '/*'))"]:
        ok, out = run(listing.format(str(target)))
        assert not ok or out == "[]", out
        assert not any(name in out for name in names), out


def test_environment_is_empty_and_parent_environment_unreachable(run, monkeypatch):
    secret = "s3cret-" + uuid.uuid4().hex
    monkeypatch.setenv("RAYRL_SECRET_KEY", secret)
    ok, out = run("import os; print(sorted(os.environ.items()))")
    assert ok and secret not in out and "RAYRL_SECRET_KEY" not in out
    assert {key for key, _ in ast.literal_eval(out)} <= {"LANG", "PATH", "TMPDIR", "PWD"}  # bwrap sets PWD
    for source in ["f'/proc/{os.getppid()}/environ'", "'/proc/self/environ'", "'/proc/1/environ'"]:
        ok, out = run(f"import os; print(open({source}, 'rb').read())")
        assert not ok and secret not in out


# ----------------------------------------------------------------------------- processes

PROCESS_ATTEMPTS = {
    "subprocess.run": f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SAY_ESCAPED!r}])",
    "os.system": f"import os, sys; os.system(sys.executable + ' -c \"{SAY_ESCAPED}\"')",
    "os.popen": f"import os, sys; print(os.popen(sys.executable + ' -c \"{SAY_ESCAPED}\"').read())",
    "os.fork": f"import os; os.fork(); {SAY_ESCAPED}",
    "os.execv": f"import os, sys; os.execv(sys.executable, [sys.executable, '-c', {SAY_ESCAPED!r}])",
    "os.posix_spawn": f"import os, sys; os.posix_spawn(sys.executable, [sys.executable, '-c', {SAY_ESCAPED!r}], {{}})",
    "os.spawnv": f"import os, sys; os.spawnv(os.P_WAIT, sys.executable, [sys.executable, '-c', {SAY_ESCAPED!r}])",
    "pty.spawn": f"import pty, sys; pty.spawn([sys.executable, '-c', {SAY_ESCAPED!r}])",
    "multiprocessing": "import multiprocessing as mp\np = mp.Process(target=print, args=('ESC' + 'APED',))\n"
                       "p.start(); p.join()",
    "fork_exec": "import _posixsubprocess, os, sys\nr, w = os.pipe()\nexe = os.fsencode(sys.executable)\n"
                 f"_posixsubprocess.fork_exec([exe, b'-c', {SAY_ESCAPED.encode()!r}], [exe], True, (w,), None, "
                 "None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)",
    "fresh _posixsubprocess": "import importlib.util as u, _posixsubprocess\n"
                              "spec = u.spec_from_file_location('_posixsubprocess', _posixsubprocess.__file__)\n"
                              f"print(u.module_from_spec(spec).fork_exec); {SAY_ESCAPED}",
    "ctypes system": "import ctypes; ctypes.CDLL(None).system(b'echo ESC''APED')",
    "_ctypes dlopen": "import _ctypes; _ctypes.dlopen(None)",
    "signal the parent": f"import os; os.kill(os.getppid(), 0); {SAY_ESCAPED}",
}


@pytest.mark.parametrize("name", sorted(PROCESS_ATTEMPTS))
def test_processes_cannot_start(run, name):
    ok, out = run(PROCESS_ATTEMPTS[name], timeout=10.0)
    assert not ok and ESCAPED not in out, out


def test_fork_bomb_is_refused_quickly(run):
    start = time.monotonic()  # bounded (at most 2**8 processes) in case a broken hook let it through
    ok, out = run(f"import os\nfor _ in range(8):\n    os.fork()\n{SAY_ESCAPED}", timeout=10.0)
    assert not ok and ESCAPED not in out and "timed out" not in out
    assert time.monotonic() - start < 8.0


# ----------------------------------------------------------------------------- network


@pytest.fixture
def listener():
    """A loopback TCP server on the host; a sandbox must never reach it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server.getsockname()[1]
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody connected
    server.close()


NETWORK_ATTEMPTS = {
    "socket": "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')",
    "_socket": "import _socket; s = _socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {port})); s.send(b'x')",
    "socket reimported": "import sys; sys.modules.pop('socket', None); sys.modules.pop('_socket', None)\n"
                         "import socket; socket.socket().connect(('127.0.0.1', {port}))",
    "urllib": "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
    "udp": "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
    "unix socket": "import socket; socket.socket(socket.AF_UNIX).connect('/run/docker.sock')",
    "dns": "import socket; socket.getaddrinfo('pypi.org', 443)",
}


@pytest.mark.parametrize("name", sorted(NETWORK_ATTEMPTS))
def test_network_is_unreachable(run, listener, name):
    ok, out = run(NETWORK_ATTEMPTS[name].format(port=listener) + "\n" + SAY_ESCAPED, timeout=10.0)
    assert not ok and ESCAPED not in out, out


# ----------------------------------------------------------------------------- resources


def test_memory_bomb_is_refused_and_the_parent_keeps_its_limits(run):
    before = resource.getrlimit(resource.RLIMIT_AS)
    ok, out = run("x = bytearray(2 * 1024 ** 3)", memory_mb=256)
    assert not ok and "MemoryError" in out
    ok, out = run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))", memory_mb=256, timeout=10.0)
    assert not ok and "MemoryError" in out
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(300 * 1024 ** 2)) == 300 * 1024 ** 2  # the parent is not limited


def test_cpu_loop_times_out(run):
    start = time.monotonic()
    ok, out = run("while True: pass", timeout=1.0)
    assert not ok and out.endswith("timed out after 1.0s")
    assert time.monotonic() - start < 1.0 + 4.0


def test_output_is_capped(run):
    ok, out = run("print('x' * 10 ** 8)", max_output=1000)
    assert ok and len(out) <= 1000 and out.startswith("[output truncated]") and out.endswith("x" * 900)
    start = time.monotonic()
    ok, out = run("while True:\n    print('y' * 1000)", max_output=500, timeout=1.5)
    assert not ok and len(out) <= 500 and out.endswith("timed out after 1.5s")
    assert time.monotonic() - start < 1.5 + 4.0


def test_huge_files_are_refused(run):
    ok, out = run("open('big', 'wb').write(b'x' * (64 * 1024 ** 2))", disk_mb=8)
    assert not ok and ("File too large" in out or "No space left" in out)


def test_limits_and_the_hook_cannot_be_undone(run):
    for attempt in ["import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
                    "import gc; print(len(gc.get_objects()))",
                    "import os; os.chdir('/')",
                    "import sys; del sys.modules['posix']; import posix",
                    "import os; os.mknod('node')"]:
        ok, out = run(attempt)
        assert not ok, attempt


# ----------------------------------------------------------------------------- the layers


def test_namespaces_alone_block_processes_network_and_host_files(listener, secret_file):
    """bubblewrap + seccomp without the in-process layer: the kernel refuses on its own."""
    bwrap, why = sandbox._probe_bwrap()
    if bwrap is None:
        pytest.skip(f"bubblewrap cannot create namespaces on this machine: {why}")
    path, secret = secret_file
    checks = {
        "fork": "import os; os.fork()",
        "network": f"import socket; socket.create_connection(('127.0.0.1', {listener}), timeout=2)",
        "host file": f"print(open({str(path)!r}).read())",
        "shadow": "print(open('/etc/shadow').read())",
        "write /tmp": f"open('/tmp/{_unique('tmp')}', 'w')",
        "write root": "open('/x', 'w')",
    }
    for name, code in checks.items():
        with sandbox._seccomp_fd() as fd:
            argv = sandbox._bwrap_argv(bwrap, fd, disk_mb=8) + [sandbox._interpreter(), "-I", "-S", "-c", code]
            ok, out = sandbox._run_bounded(argv, cwd="/", env=sandbox._child_env(sandbox._SCRATCH), timeout=10.0,
                                         max_output=2000, pass_fds=(fd,) if fd is not None else ())
        assert not ok and secret not in out, (name, out)
        assert ("Error" in out), (name, out)


def test_without_namespaces_the_default_is_to_refuse(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe_bwrap", lambda: (None, "no user namespaces (test)"))
    monkeypatch.delenv(sandbox.ALLOW_UNISOLATED_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="no user namespaces"):
        run_python_sandboxed("print(1)")
    with pytest.raises(SandboxUnavailable):  # the tool executor does not turn this into a model message
        create_tool_executor({"python": python_tool})(ToolCall("python", {"code": "print(1)"}, "c0"))
    monkeypatch.setenv(sandbox.ALLOW_UNISOLATED_ENV, "1")
    with pytest.raises(SandboxUnavailable):
        run_python_sandboxed("print(1)", allow_unisolated=False)  # the argument wins over the variable
    sandbox._warn_unisolated.cache_clear()
    with pytest.warns(RuntimeWarning, match="WITHOUT OS isolation"):
        assert run_python_sandboxed("print(1)") == (True, "1")


def test_this_machine_isolates():
    """On Linux with the bundled bwrap, the sandbox uses namespaces unless the kernel forbids them."""
    bwrap, why = sandbox._probe_bwrap()
    if bwrap is None and os.environ.get("RAYRL_REQUIRE_SANDBOX") == "1":
        pytest.fail(f"RAYRL_REQUIRE_SANDBOX=1 but bubblewrap does not work here: {why}")
    if bwrap is None:
        pytest.skip(f"bubblewrap cannot create namespaces on this machine: {why}")
    assert run_python_sandboxed("import os; print(os.getcwd(), os.getuid())") == (True, "/scratch 65534")
