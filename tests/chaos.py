"""Kill Ray actors from outside, by PID, as a failing machine would: find an actor's process by
the title Ray gives it (``ray::<Class>`` idle, ``ray::<Class>.<method>`` while it runs a call)
and send it a signal. No Ray API is used: the run under test learns of the death as it would
of a real one."""
from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
from typing import Collection, Optional

import psutil

TIER_ENV = "RAYRL_TEST_TIER"  # the tier of make test a process runs (tests/suite.py); its Rays inherit it
ROLE_CLASSES = {"trainer": "TrainerWorker", "critic": "CriticWorker", "reference": "RefLogprobWorker",
                "generator": "GeneratorWorker", "reward": "RewardWorker"}


def actor_pids(cls: str, method: str = "", since: float = 0.0) -> list:
    """PIDs of this test run's live processes running actor class ``cls`` (and, given, inside a
    call of ``method``), started after ``since`` (a ``time.time()``: an earlier run's workers
    may linger), oldest first. This run's: descendants of this process (every Ray it starts, the
    simulated nodes' too, is), never another Ray's on the same machine (a ``make run`` or a second
    test run beside this one), which a kill here must not reach."""
    found, me = [], os.getpid()
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        if (_runs(" ".join(p.info["cmdline"] or ()), cls, method) and p.info["create_time"] >= since
                and p.info["status"] != psutil.STATUS_ZOMBIE and _in_tree(p.info["pid"], me)):
            found.append((p.info["create_time"], p.info["pid"]))
    return [pid for _, pid in sorted(found)]


def _runs(title: str, cls: str, method: str) -> bool:
    """Whether a process titled ``title`` is an actor of ``cls`` (inside a call of ``method``, given)."""
    want = f"ray::{cls}.{method}" if method else f"ray::{cls}"
    return title.startswith(want) and bool(method or title[len(want):len(want) + 1] in ("", " ", "."))


def _still_runs(pid: int, cls: str, method: str) -> bool:
    """``_runs`` read again for one process: a listing of every process takes long enough on a busy
    machine for a short call to end in between, and the signal to land in the actor's next call."""
    try:
        return _runs(" ".join(psutil.Process(pid).cmdline()), cls, method)
    except psutil.Error:
        return False


def signal_when(cls: str, method: str, sig: int = signal.SIGKILL, timeout_s: float = 120.0,
                pick: Optional[random.Random] = None, among: Optional[Collection[int]] = None) -> dict:
    """Start a thread that waits until an actor of ``cls`` runs ``method`` and sends its process
    ``sig``; returns a dict the thread fills with ``pid`` (and ``at``, a ``time.time()``) once
    it has, so a test can wait for it and, after SIGSTOP, see which process it stopped. ``among``:
    only these processes (a cluster's own, where actors kept idle for another cluster would also
    match: a ``method`` of "" matches an idle actor). Given, only their titles are read, about 0.1 ms
    a process, where listing every process on the machine took 9 ms here with 66 of them and more with a
    test run's few hundred: a call of a few milliseconds (a reference worker scoring 8 rows of the tiny
    model) fell between two listings often enough that a kill never landed before the run ended."""
    done: dict = {}

    def candidates() -> list:
        if among is not None:
            return [pid for pid in among if _still_runs(pid, cls, method)]
        return actor_pids(cls, method)

    def watch() -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            pids = candidates()
            if pids:
                pid = (pick or random).choice(pids)
                if not _still_runs(pid, cls, method):
                    continue
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
                done.update(pid=pid, at=time.time())
                return
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    return done


# Ray's control store declares a node dead after this many failed health checks this far apart (5 at 3 s by
# default): a result lost with its node fails its reader then, 15 s after the loss by default and 5 s with
# these (measured here). The chaos test keeps Ray's defaults, as a user's cluster has them: a run must ride out
# the window in which the node's actors are unavailable but the node is not yet declared dead.
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class Nodes:
    """A head (the driver's node) and one node per role group, each with its own raylet and object
    store (``ray.cluster_utils.Cluster`` on this machine), as a KubeRay cluster has them: a result
    above Ray's inline limit lives in the object store of the node whose actor made it.
    ``groups``: name -> logical CPUs of that node, which advertises the custom resource
    ``<name>_node`` (``cluster.pin_roles`` places trainers, critics and reference workers on
    ``trainer_node``, generators and reward workers on ``generator_node``). ``inline_bytes``:
    Ray's inline limit (100 KB by default); a small one stores even a tiny model's chunks in the
    making node's object store, as a real model's are. ``health_checks``: Ray's health-check settings
    (its own by default; ``FAST_HEALTH_CHECKS`` to see a lost node sooner). ``remove(group)`` loses
    that node at once (no graceful stop, as a machine that fails); ``add(group)`` starts a fresh one
    in its place (from any thread: a monkey's too)."""

    def __init__(self, groups: dict, head_cpus: int = 1, inline_bytes: Optional[int] = None,
                 health_checks: Optional[dict] = None):
        import ray
        from ray.cluster_utils import Cluster

        from tests.conftest import ray_env
        from tests.zygote import ray_workers_forked

        self.groups = dict(groups)
        self._keeper: Optional[threading.Thread] = None
        self._asks: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        ray.shutdown()
        head = {"num_cpus": head_cpus, "include_dashboard": False, "_system_config": dict(health_checks or {})}
        if inline_bytes is not None:
            head["_system_config"]["max_direct_call_object_size"] = int(inline_bytes)
        with ray_workers_forked(ray_env()):  # tests/zygote.py: workers forked, as on the run's own Ray
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
            self.nodes = {name: self._start(name) for name in self.groups}
            self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)

    def _start(self, name: str):
        from tests.conftest import ray_env
        from tests.zygote import ray_workers_forked

        with ray_workers_forked(ray_env()):
            return self.cluster.add_node(num_cpus=self.groups[name], resources={f"{name}_node": 1})

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes[name], allow_graceful=False)

    def add(self, name: str) -> None:
        """A fresh node for group ``name`` (from any thread). Ray starts a node's processes bound to
        the life of the thread that starts them (``PR_SET_PDEATHSIG``): a node added from a thread
        that then ends dies with it. So every node is added by one keeper thread that lives as long
        as the cluster (and the node's SIGTERM hook, which only the main thread may set, is left out)."""
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, daemon=True)
            self._keeper.start()
        done: dict = {}
        self._asks.put((name, done))
        while "node" not in done and "error" not in done:
            time.sleep(0.05)
        if "error" in done:
            raise done["error"]
        self.nodes[name] = done["node"]
        self.cluster.wait_for_nodes()

    def _keep(self) -> None:
        from unittest import mock

        while (ask := self._asks.get()) is not None:
            name, done = ask
            try:
                with mock.patch("ray._private.utils.set_sigterm_handler"):
                    done["node"] = self._start(name)
            except Exception as error:  # handed to the asking thread
                done["error"] = error
        self._stopped.wait()  # the nodes it started go down with the cluster, not before

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self._keeper is not None:
            self._asks.put(None)
            self._stopped.set()
            self._keeper.join(10)


def our_scratch() -> list:
    """Our scratch directories (``rl_actors.scratch``) in shared memory and the temporary directory,
    of live processes or not: after a run has shut its cluster down there must be none. Those of live
    processes of another tier of ``make test`` (``tests/suite.py`` names each tier in its processes'
    environment, which its Rays' raylets and workers inherit, a ``ray start`` head's too) are that
    tier's; one of a process that has ended is counted, as is one of a live process without a tier
    (an orphaned worker of this run inherits this tier's name). A directory removed while it was
    looked at is not counted."""
    from rl_actors.scratch import ours

    mine = os.environ.get(TIER_ENV)
    return [path for path, pid in ours() if not _of_another_tier(pid, mine) and os.path.exists(path)]


def _of_another_tier(pid: int, mine: Optional[str]) -> bool:
    try:
        tier = psutil.Process(pid).environ().get(TIER_ENV)
    except psutil.Error:  # ended
        return False  # (a zombie's environment reads empty: it is counted too)
    return tier is not None and tier != mine


def _in_tree(pid: int, root: int) -> bool:
    """Whether live process ``pid`` is ``root`` or descends from it."""
    try:
        process = psutil.Process(pid)
        return pid == root or any(parent.pid == root for parent in process.parents())
    except psutil.Error:
        return False


def cut_sender(address, meta: list, bucket_bytes: int, sent: int, linger_s: float = 3.0) -> None:
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

