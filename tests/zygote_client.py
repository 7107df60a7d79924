"""The Python a test's raylet starts its workers with (``tests/zygote.py``): ``python -I -S
zygote_client.py <what Ray asked Python to run>``. A plain worker is forked by the zygote and this
process stands in for it (its pid, its signals, its exit); anything else, or no zygote, and it
becomes the real Python with the same arguments. Standard library only: it starts for every worker."""
import array
import json
import os
import signal
import socket
import sys
from typing import NoReturn

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def as_asked(args: list) -> NoReturn:
    """Become the real Python (the one running this file: the shim names it) with ``args``."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # an exec keeps the mask
    os.execv(sys.executable, [sys.executable, *args])


def main(args: list) -> None:
    path = os.environ.get("RAYRL_ZYGOTE_SOCKET")
    if not path or not args or os.path.basename(args[0]) != "default_worker.py":
        as_asked(args)
    # held until the child's pid is known, then forwarded to it: none is lost, none kills this process first
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {"argv": ["python", *args], "env": dict(os.environ), "cwd": os.getcwd()}
        sock.sendmsg([json.dumps(request).encode() + b"\n"],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        replies = sock.makefile("rb")
        first = replies.readline().strip()
    except OSError:  # no zygote
        sock.close()
        as_asked(args)
    if first == b"refused" or not first:  # refused, or the zygote failed before it forked
        sock.close()
        as_asked(args)
    pid = int(first)

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    line = replies.readline()
    if not line:  # the zygote went first: the child's status is lost
        os._exit(1)
    status = int(line)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
