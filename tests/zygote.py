"""The test run's actor processes forked from one that has already imported torch, transformers and
DeepSpeed (a zygote, as Android starts its apps), instead of each importing them again.

Why: a Ray worker process spends 5-6 CPU-s importing those libraries before its actor does any
work (a vLLM generator about 6 more for vLLM's engine, also preloaded), and the suite starts about
220 of them (new shapes, replacements, nodes of their own): about half of the run's CPU on 2 cores.
A fork of a process that has them costs a few milliseconds.

How: the Ray that a test starts (``ray_workers_forked``: the run's shared Ray, the simulated nodes)
gets this module's client (``tests/zygote_client.py``, through a small executable standing in for
``sys.executable``) as the Python its raylet starts workers with. For a plain worker
(``python default_worker.py ...``) the client hands its arguments, environment, working directory
and standard streams to the zygote, which forks; the child becomes the worker in the client's
place, and the client waits for it and exits as it did. SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1
and SIGUSR2 sent to the client reach the child; a client killed outright takes its child with it.
Anything else, a worker whose environment differs in what the preloaded libraries read at import
(``IMPORT_ENV``), or no zygote, and the client runs the real Python as Ray asked: that worker starts
as it would without this module.

What differs from a worker started as usual, and why it does not matter here:
* the libraries were imported under the zygote's environment: a worker that differs in what they
  read is not forked, and the zygote serves nothing where DeepSpeed picked an accelerator other than
  the CPU (an actor on the CPU sets ``DS_ACCELERATOR`` before it first imports DeepSpeed);
* the child's parent is the zygote, not the raylet: a worker follows its raylet by the raylet's pid
  (``RAY_RAYLET_PID``) and socket, not by its parent;
* numpy's global generator is seeded again in each child (Python's own ``random`` reseeds itself at a
  fork), but every forked worker shares the zygote's string-hash secret, so set and dict orders
  agree across the tests' actors where a real cluster's differ (no code here depends on that order);
* the zygote ignores a Ctrl-C in the test run's terminal (its children take theirs as any process);
* every forked worker holds vLLM's engine modules, imported with Ray hidden, so vLLM's Ray executor helpers
  (``vllm.v1.executor.ray_utils``) hold no Ray: the vLLM generators run one process each on the CPU
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), never Ray's executor; vLLM's import also patched torch's inductor
  in memory, in every worker, which matters only to ``torch.compile``'s inductor, which no actor here uses
  on the CPU; the variables vLLM's import set are not passed on (``_import_vllm``).
Tests that start Ray by other means (``ray start`` for ``ray job submit``, the product's
``start_ray``) get workers started as usual, so that path keeps its tests.
``RAYRL_TEST_FORK_WORKERS=0`` turns it off for a whole run.
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

# what the zygote imports before it forks: what most actors import at start (the trainer, reference,
# critic and HF generator roles), and vLLM's engine (a vLLM generator spent about 6 s of its start importing
# it). After the fork a worker still spends 0.5 to 1 CPU-s, most of it importing Ray. Not Ray: workers forked
# from a zygote that had imported it (with vLLM, which imports it where it can) died before they registered.
# vLLM is imported ``without_ray``. Nothing that starts a thread at import (pyarrow does)
PRELOAD = ("numpy", "torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "deepspeed", "peft",
           "safetensors.torch", "vllm.entrypoints.llm", "vllm.distributed.weight_transfer")
# a worker whose variables of these prefixes differ from the zygote's start environment is not forked: the
# preloaded libraries read them at import (threads, paths, hub and backend settings)
IMPORT_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HF_",
              "DS_", "DEEPSPEED_", "CUDA_", "NCCL_", "MALLOC_", "GLIBC_TUNABLES", "TQDM_", "NPY_", "NUMPY_", "USE_",
              "XDG_", "HOME", "VLLM_")
IMPORT_ENV_IGNORED = ("PYTHONBREAKPOINT",)  # set per worker by Ray, read at a breakpoint() call
SOCKET_ENV = "RAYRL_ZYGOTE_SOCKET"
SHIM_PREFIX = "rayrl-zygote-"  # the directory of a zygote's socket, log and stand-in executable
# the real interpreter, taken before any ``ray_workers_forked`` stands its shim in for it: a zygote, and each
# shim, run this one (a shim that ran another shim would start itself over and over)
PYTHON = sys.executable
# room in the child's command line for Ray's process titles (``ray::TrainerWorker.train_step``): a title is
# cut to the length of the command line the process started with, and the tests find actors by title
TITLE_ROOM = 400


def import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV) and k not in IMPORT_ENV_IGNORED}


def _recv_request(conn: socket.socket) -> tuple:
    """``(request, fds)``: one JSON line and the descriptors sent with it (closed again if the request
    does not arrive whole)."""
    fds, data = array.array("i"), b""
    try:
        while not data.endswith(b"\n"):
            msg, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(8 * fds.itemsize))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            if not msg:
                raise EOFError("the client left before its request ended")
            data += msg
        request = json.loads(data)
        if not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict) or len(fds) != 3:
            raise ValueError("not a worker's request")
        return request, list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


@contextlib.contextmanager
def without_ray():
    """Inside: ``import ray`` fails, as where Ray is not installed. vLLM imports Ray where it can (its Ray
    executor's helpers); a zygote that had imported Ray forked workers that died before they registered.
    After it, ``sys.modules["ray"]`` is what it was (absent, a module, or an outer block's None)."""
    saved = sys.modules.get("ray", _ABSENT)
    sys.modules["ray"] = None
    try:
        yield
    finally:
        if saved is _ABSENT:
            sys.modules.pop("ray", None)
        else:
            sys.modules["ray"] = saved


_ABSENT = object()


def _import_vllm(name: str) -> None:
    """Import vLLM's module ``name`` with Ray hidden, leaving ``os.environ`` as it was: vLLM's import sets
    variables for its own compilation and GPU checks (``TORCHINDUCTOR_COMPILE_THREADS``,
    ``PYTORCH_NVML_BASED_CUDA_CHECK`` and others), which a forked trainer rank, that never imports vLLM
    where the product runs, should not get. Without vLLM (an install without its extra), the zygote
    serves without it."""
    environment = dict(os.environ)
    try:
        with without_ray():
            __import__(name)
    except ImportError as exc:
        print(f"zygote: {name} not preloaded ({type(exc).__name__}: {exc})", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(environment)


def _preload(names) -> dict:
    """Import ``names``; the variables the imports set (vLLM's excepted, ``_import_vllm``). Exits (no
    zygote: workers start as usual) where DeepSpeed picked an accelerator other than the CPU: an actor on
    the CPU sets ``DS_ACCELERATOR`` before its first import of DeepSpeed (``rl_actors.deepspeed_rank``),
    which a forked worker has already had."""
    before = dict(os.environ)
    for name in names:
        if name.startswith("vllm"):
            _import_vllm(name)
        else:
            __import__(name)
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            print(f"zygote: DeepSpeed chose {get_accelerator().device_name()}, not the CPU: not serving", flush=True)
            sys.exit(0)
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def serve(path: str, parent: int, preload=PRELOAD) -> tuple:
    """Import ``preload``, then fork one child per request on the Unix socket ``path``, reporting
    each child's pid and, when it ends, its wait status to the requesting client. Returns only in a
    child: ``(connection, request, fds)``. Ends once process ``parent`` (the test run) has gone, and
    removes the directory of ``path`` (the run's to remove had it stopped the zygote); a client that
    vanishes, or a request it cannot serve, costs that request alone."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the test run's terminal is the run's to take
    start_env = import_env(dict(os.environ))
    added = _preload(preload)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # clients find the socket only once it listens
    listener.settimeout(0.2)
    children: dict = {}
    print(f"zygote {os.getpid()}: ready ({', '.join(preload)})", flush=True)
    while _alive(parent):
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            conn = None
        if conn is not None:
            try:
                child = _answer(conn, start_env, added, children)
            except Exception as exc:  # a client gone, a bad request, a fork refused: that request alone fails
                print(f"zygote: a request failed ({type(exc).__name__}: {exc})", flush=True)
                conn.close()
                child = None
            if child is not None:  # in the child
                listener.close()
                return child
        _reap(children)
    print("zygote: the test run has gone", flush=True)
    here = os.path.dirname(path)
    if os.path.basename(here).startswith(SHIM_PREFIX):  # its directory, which the run did not live to remove
        shutil.rmtree(here, ignore_errors=True)
    sys.exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _answer(conn: socket.socket, start_env: dict, added: dict, children: dict) -> Optional[tuple]:
    """Serve one client: refuse it, or fork. In the child: ``(conn, request, fds)``; in the zygote: None."""
    conn.settimeout(10.0)  # a client that connects and stalls does not hold up the other raylets
    request, fds = _recv_request(conn)
    differ = sorted(k for k in set(start_env) | set(import_env(request["env"]))
                    if k not in added and start_env.get(k) != request["env"].get(k))
    if differ:
        for fd in fds:
            os.close(fd)
        print(f"zygote: not forked, these differ from the zygote's start: {differ}", flush=True)
        conn.sendall(b"refused\n")
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    if pid == 0:
        try:
            import signal

            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
            for other in children.values():
                other.close()
            conn.settimeout(None)
            request["env"] = {**added, **request["env"]}
            return conn, request, fds
        except BaseException:  # never a second zygote
            os._exit(70)
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    print(f"zygote: forked {pid}", flush=True)
    conn.sendall(f"{pid}\n".encode())  # a client gone by now: its child follows it out (``become_worker``)
    return None


def _reap(children: dict) -> None:
    """Collect the children that have ended and tell their clients how."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{status}\n".encode())
            conn.close()


def become_worker(conn: socket.socket, request: dict, fds: list) -> None:
    """In a fresh child: take the client's streams, directory and environment, follow the client's
    life (its socket closing ends this process), and run the worker script as ``__main__``."""
    import runpy
    import signal
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    env = {k: v for k, v in request["env"].items() if k != SOCKET_ENV}
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh global generator per process, as at numpy's import

    def follow_client() -> None:
        with contextlib.suppress(OSError):
            while conn.recv(64):
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=follow_client, name="zygote-client", daemon=True).start()
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as for ``python <script>``, not the zygote's
    runpy.run_path(script, run_name="__main__")


class Zygote:
    """A zygote process started with the environment ``env`` (its raylets' own), and the executable
    that stands in for Python in those raylets."""

    def __init__(self, env: dict, preload=PRELOAD):
        if os.path.basename(os.path.dirname(PYTHON)).startswith(SHIM_PREFIX):
            raise RuntimeError(f"tests/zygote.py was first imported with a zygote's shim as sys.executable ({PYTHON})")
        self.dir = tempfile.mkdtemp(prefix=SHIM_PREFIX)
        self.socket = os.path.join(self.dir, "sock")
        self.python = PYTHON
        self.log = os.path.join(self.dir, "zygote.log")
        self._lines: Optional[list] = None
        here = os.path.dirname(os.path.abspath(__file__))
        self.executable = os.path.join(self.dir, "python")
        with open(self.executable, "w") as f:
            f.write(f'#!/bin/sh\nexec "{self.python}" -I -S "{os.path.join(here, "zygote_client.py")}" "$@"\n')
        os.chmod(self.executable, 0o755)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([self.python, os.path.abspath(__file__), self.socket, str(os.getpid()),
                                             "-" * TITLE_ROOM, *preload],
                                            env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def ready(self, timeout_s: float = 120.0) -> bool:
        """Whether it serves (its socket listens) and its shim runs (a temporary directory mounted
        without exec would stop every Ray process the raylet starts)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.process.poll() is None:
            if os.path.exists(self.socket):
                try:
                    ran = subprocess.run([self.executable, "-c", "pass"], timeout=60)
                except (OSError, subprocess.SubprocessError) as exc:
                    print(f"zygote: its shim does not run ({exc})", file=sys.stderr)
                    return False
                return ran.returncode == 0
            time.sleep(0.05)
        return False

    @property
    def env(self) -> dict:
        return {SOCKET_ENV: self.socket}

    @property
    def pid(self) -> int:
        return self.process.pid

    def lines(self) -> list:
        """Its log (kept once it has stopped: ``stop`` removes its directory)."""
        if self._lines is None:
            with open(self.log) as f:
                return f.read().splitlines()
        return self._lines

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._lines is None:
            self._lines = self.lines()
            shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTES: dict = {}  # the variables the preloads read at import (sorted pairs) -> its zygote, None: did not start
# one thread at a time starts a zygote or swaps sys.executable and the environment (the chaos test's keeper
# thread adds nodes while the main thread runs a job)
_LOCK = threading.RLock()


def zygote(env: dict) -> Optional[Zygote]:
    """The zygote for a raylet started with ``env`` on top of this process's environment, started on
    first use: one per distinct set of the variables the preloaded libraries read (``IMPORT_ENV``), so
    that a raylet started after this process changed one (an import that set ``LD_LIBRARY_PATH``, a
    ``DS_ACCELERATOR`` set for in-process ranks) gets one of its own. None when turned off
    (``RAYRL_TEST_FORK_WORKERS=0``) or when it did not start (its workers then start as usual)."""
    if os.environ.get("RAYRL_TEST_FORK_WORKERS", "1") == "0":
        return None
    full = {**os.environ, **env}
    key = tuple(sorted(import_env(full).items()))
    with _LOCK:
        if key not in _ZYGOTES:
            started = Zygote(full)
            if not started.ready():
                started.stop()
                print("tests/zygote.py: a zygote did not start; its raylets' workers start as usual. Its log:",
                      *started.lines()[-20:], sep="\n", file=sys.stderr)
                started = None
            _ZYGOTES[key] = started
        return _ZYGOTES[key]


def started() -> list:
    return [z for z in _ZYGOTES.values() if z is not None]


def stop() -> None:
    for z in started():
        z.stop()


def summary() -> str:
    """What the run's zygotes did: workers forked, and workers started as usual (the last one's reason)."""
    forked, refused, failed = 0, [], 0
    for z in started():
        lines = z.lines()
        forked += sum(line.startswith("zygote: forked") for line in lines)
        refused += [line for line in lines if "not forked" in line]
        failed += sum(line.startswith("zygote: a request failed") for line in lines)
    missing = sum(z is None for z in _ZYGOTES.values())
    return (f"{len(started())} zygote(s)" + (f" ({missing} more did not start)" if missing else "")
            + f", {forked} Ray workers forked, {len(refused)} started as usual"
            + (f" (the last: {refused[-1]})" if refused else "") + (f", {failed} requests failed" if failed else ""))


@contextlib.contextmanager
def ray_workers_forked(env: dict):
    """Inside: ``env`` set, and a raylet started here (``ray.init``, ``Cluster.add_node``) starts its
    workers through the zygote."""
    from rl_actors.common import environ

    with _LOCK:
        z = zygote(env)
        extra = z.env if z is not None else {}
        outer = sys.executable  # the real one, or an enclosing block's shim
        with environ({**env, **extra}):
            if z is not None:
                sys.executable = z.executable
            try:
                yield
            finally:
                sys.executable = outer


if __name__ == "__main__":
    become_worker(*serve(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[4:])))
