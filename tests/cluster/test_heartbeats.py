"""Heartbeats: an actor whose process stops is found within ``cluster.heartbeat_s`` (plus the
driver's reading interval), named alone, long before the call timeout; a healthy call longer than
the bound is left alone; an actor with no heartbeat is left to the call timeout; a killed actor's
count leaves Ray's key-value store.

The tests on Ray are marked ``apart``: they wait out bounds and calls of seconds, so under ``make test`` they run
beside the Ray tests, on their tier's own Ray (``tests/suite.py``)."""
import os
import signal
import time

import pytest

from cluster.loop.protocol import ActorFailure
from cluster.ray_wing.groups import CHECK_S, HEARTBEATS, Call, Heartbeats, actor_id, gather, watch_heartbeats


def test_a_count_is_stale_once_it_has_not_moved_for_the_bound_seen_from_the_driver():
    now, counts = [0.0], {"a": 1, "b": 1, "c": None}
    beats = Heartbeats(60.0, read=lambda ids: {i: counts.get(i) for i in ids}, clock=lambda: now[0])
    actors = {"a", "b", "c"}
    assert beats.stale(actors) == set()  # first seen at t = 0
    now[0], counts["a"] = 30.0, 2  # a beats; b has stopped; c never beat (left to the call timeout)
    assert beats.stale(actors) == set()
    now[0] = 59.9
    assert beats.stale(actors) == set()
    now[0] = 60.0
    assert beats.stale(actors) == {"b"}
    now[0] = 89.9  # a's count last moved when seen at t = 30
    assert beats.stale(actors) == {"b"}
    now[0] = 90.0
    assert beats.stale(actors) == {"a", "b"}
    counts["b"] = 7  # b beats again (it was only slow): no longer stale, its clock starts again
    assert beats.stale(actors) == {"a"} and beats.stale({"b"}) == set()
    assert beats.stale(set()) == set()
    assert Heartbeats(0.0, read=lambda ids: {i: 1 for i in ids}, clock=lambda: 1e9).stale(actors) == set()  # off


def test_the_default_finds_a_stopped_process_within_a_minute():
    from cluster.ray_wing.config import ClusterConfig
    from rl_actors.common import HEARTBEAT_EVERY_S

    # the last beat, then at most one reading interval until the driver sees that count, then the bound
    assert HEARTBEAT_EVERY_S + CHECK_S + ClusterConfig().heartbeat_s + CHECK_S <= 60


def test_outside_an_actor_no_heartbeat_starts(monkeypatch):
    """A trainer rank built in a plain process (the GPU check, a notebook) starts no thread, with Ray
    not imported, imported but not started, or blocked from importing (``sys.modules["ray"] = None``)."""
    import sys

    from rl_actors.common import start_heartbeat

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert start_heartbeat() is False
    monkeypatch.setitem(sys.modules, "ray", None)
    assert start_heartbeat() is False


class Sleeper:
    """An actor with a heartbeat (``setup_process`` starts it) that sleeps when asked."""

    def __init__(self, beat: bool = True):
        from rl_actors.common import setup_process

        if beat:
            setup_process(needs_torch=False)

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def refaults(self) -> tuple:
        from rl_actors.common import refaults

        return refaults()


BOUND_S = 5.0


@pytest.fixture
def heartbeat_5s(monkeypatch):
    """A 5 s bound, the heartbeats read every second (the product reads them every ``CHECK_S``, 5 s,
    against 45 s): a stopped actor is found in seconds, and a healthy one, beating every 2 s, has 3 s
    to spare on each reading."""
    from cluster.ray_wing import groups

    monkeypatch.setattr(groups, "CHECK_S", 1.0)
    before = HEARTBEATS.stale_s
    watch_heartbeats(BOUND_S)
    yield
    watch_heartbeats(before)


def _call(ray, actor, seconds):
    return Call(actor.sleep.remote(seconds), "generator", 0, "sleep", actor_id(actor))


@pytest.mark.apart
def test_an_actor_keeps_the_memory_it_frees_for_its_next_tensors(ray_local):
    """``setup_process`` in an actor makes freed memory stay for reuse (``reuse_freed_memory``;
    a plain process keeps glibc's default: ``test_reusable.py``): an 80 MB block filled again
    after one was freed faults in almost none of its pages."""
    actor = ray_local.remote(num_cpus=0)(Sleeper).remote()
    try:
        first, second, _, _ = ray_local.get(actor.refaults.remote(), timeout=60)
    finally:
        ray_local.kill(actor)
    assert first > 0 and second <= 0.05 * first, (first, second)


@pytest.mark.apart
def test_a_healthy_call_longer_than_the_bound_is_left_alone(ray_local, heartbeat_5s):
    actor = ray_local.remote(num_cpus=0)(Sleeper).remote()
    try:
        assert gather([_call(ray_local, actor, 12.0)], timeout_s=120) == [12.0]  # 12 readings, 2.4 bounds
    finally:
        ray_local.kill(actor)


@pytest.mark.apart
def test_a_stopped_actor_is_named_within_the_bound_not_the_call_timeout(ray_local, heartbeat_5s):
    actor = ray_local.remote(num_cpus=0)(Sleeper).remote()
    quiet = ray_local.remote(num_cpus=0)(Sleeper).remote(beat=False)
    pid = ray_local.get(actor.pid.remote(), timeout=60)
    time.sleep(3)  # a beat or two
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ActorFailure, match=r"no heartbeat for 5s from: generator 0\.sleep") as failure:
            gather([_call(ray_local, actor, 1.0), Call(quiet.sleep.remote(30.0), "reward", 0, "sleep",
                                                       actor_id(quiet))], timeout_s=300)
        waited = time.monotonic() - t0
        assert failure.value.stuck and failure.value.late == (("generator", 0),)  # the quiet one is not named
        assert BOUND_S <= waited < 3 * BOUND_S, waited  # not before the bound; the 300 s call timeout is far
    finally:
        os.kill(pid, signal.SIGCONT)
        ray_local.kill(actor)
        ray_local.kill(quiet)


@pytest.mark.apart
def test_a_killed_actors_heartbeat_leaves_the_key_value_store(ray_local):
    """``kill_group`` (every kill the driver makes) drops the actor's count: a long-lived cluster
    would otherwise hold one key per actor it ever started."""
    from ray.experimental.internal_kv import _internal_kv_get

    from cluster.ray_wing.groups import WorkerGroup, kill_group
    from rl_actors.common import HEARTBEAT_EVERY_S, HEARTBEAT_KEY

    actor = ray_local.remote(num_cpus=0)(Sleeper).remote()
    key = (HEARTBEAT_KEY + actor_id(actor)).encode()
    ray_local.get(actor.pid.remote(), timeout=60)
    deadline = time.monotonic() + 30
    while _internal_kv_get(key) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _internal_kv_get(key) is not None  # it beats
    kill_group(WorkerGroup("generator", (actor,)))
    time.sleep(HEARTBEAT_EVERY_S + 1)  # a beat it might still have sent would be back by now
    assert _internal_kv_get(key) is None
