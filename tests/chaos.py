"""Kill Ray actors from outside, by PID, as a failing machine would: find an actor's process by
the title Ray gives it (``ray::<Class>`` idle, ``ray::<Class>.<method>`` while it runs a call)
and send it a signal. No Ray API is used: the run under test learns of the death as it would
of a real one."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Optional

import psutil

ROLE_CLASSES = {"trainer": "TrainerWorker", "critic": "CriticWorker", "reference": "RefLogprobWorker",
                "generator": "GeneratorWorker", "reward": "RewardWorker"}


def actor_pids(cls: str, method: str = "", since: float = 0.0) -> list:
    """PIDs of this machine's live processes running actor class ``cls`` (and, given, inside a
    call of ``method``), started after ``since`` (a ``time.time()``: an earlier run's workers
    may linger), oldest first."""
    want = f"ray::{cls}.{method}" if method else f"ray::{cls}"
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        title = " ".join(p.info["cmdline"] or ())
        if (title.startswith(want) and (method or title[len(want):len(want) + 1] in ("", " ", "."))
                and p.info["create_time"] >= since and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append((p.info["create_time"], p.info["pid"]))
    return [pid for _, pid in sorted(found)]


def signal_when(cls: str, method: str, sig: int = signal.SIGKILL, timeout_s: float = 120.0,
                pick: Optional[random.Random] = None) -> dict:
    """Start a thread that waits until an actor of ``cls`` runs ``method`` and sends its process
    ``sig``; returns a dict the thread fills with ``pid`` (and ``at``, a ``time.time()``) once
    it has, so a test can wait for it and, after SIGSTOP, see which process it stopped."""
    done: dict = {}

    def watch() -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            pids = actor_pids(cls, method)
            if pids:
                pid = (pick or random).choice(pids)
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
                done.update(pid=pid, at=time.time())
                return
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    return done


def our_scratch() -> list:
    """Our scratch directories (``rl_actors.scratch``) in shared memory and the temporary directory,
    of live processes or not: after a run has shut its cluster down there must be none."""
    from rl_actors.scratch import ours

    return [path for path, _ in ours()]


def cut_sender(address, meta: list, bucket_bytes: int, sent: int, linger_s: float = 10.0) -> None:
    """Trainer rank 0 of a weight sync that dies mid-way: joins the sync group at ``address`` as
    rank 0, broadcasts the buckets of the first ``sent`` tensors of ``meta`` (random values), gives
    the receivers ``linger_s`` to take them in, and exits as a killed process would, without
    closing anything (run it in a process of its own)."""
    import torch

    from rl_actors.weight_sync import broadcast_buckets, init_sync_group

    torch.set_num_threads(1)
    group = init_sync_group(address, 0, timeout_s=120)
    broadcast_buckets(group, meta[:sent], bucket_bytes, 0, torch.device("cpu"),
                      get_tensors=lambda ms: [torch.randn(m.shape).to(getattr(torch, m.dtype)) for m in ms])
    time.sleep(linger_s)
    os._exit(1)

