"""Actors kept for the driver's next cluster of the same shape (``RAYRL_REUSE_ACTORS=1``).

A trainer, generator or reference actor spends most of its start importing torch, transformers
and DeepSpeed (6-8 s of CPU per process; a reward worker imports Ray and its reward's module); a
job of a few steps on a small model spends less than that on its steps. A driver that runs many
such jobs one after the other (a sweep, a notebook, the test suite) can keep the actors of one
cluster for the next: at shutdown each kept actor drops its job (``rl_actors.reuse.Reusable.release``:
models, engines, process groups) and waits in its placement group; the next cluster whose role has
the same actor class, count, bundle and strategy rebuilds those actors with its own keywords
(``rebuild``) instead of starting new processes. A rebuilt actor computes what a new one would
(the tests compare runs on kept and on new actors); what it keeps is its imports, and its Ray
actor id. Among those imports, a kept reward worker keeps the module of a reward function named
``package.module:fn`` as its first job imported it: edit that module and start new actors. A
function from a ``file.py`` travels by value, and is new with every job.

Kept groups of several shapes wait side by side, up to ``RAYRL_KEPT_MAX`` actors in all (8 by
default: each holds its imports, about 0.55 GB for a torch actor here) and half the Ray's CPUs; past
that the groups kept longest ago go first, and the last cluster's own stay whole. A new cluster takes
the groups of its shapes, then frees the oldest of the others that hold what it lacks (kills their
actors, removes their placement groups) until its own bundles fit in what the Ray has free, before
it asks for them, so kept actors never hold resources a new cluster needs. On a Ray of several
nodes it frees every group it does not take: what is free in all may not be free where a bundle
must go. Critics are kept too (``add_critics`` takes them). Not kept: a vLLM
generator (``reusable``), a group grown, shrunk or repaired into a placement group of its own while
it ran, an actor that does not let go of its job in time, and anything of a run that failed.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Sequence

from cluster.ray_wing.groups import (
    Call,
    WorkerGroup,
    actor_id,
    create_group,
    fan_out,
    gather,
    group_shape,
    kill_group,
)
from cluster.ray_wing.placement import RoleSpec, create_placement_groups, total_request

REUSE_ENV = "RAYRL_REUSE_ACTORS"  # "1": keep the actors of each cluster for the next of the same shape
RELEASE_S = 30.0  # an actor that has not dropped its job by then is killed, not kept
KEPT_ROLES = ("trainer", "generator", "reward", "reference", "critic")
KEPT_MAX_ENV = "RAYRL_KEPT_MAX"  # most actors kept at once, over every shape
KEPT_MAX = 8


class Kept(NamedTuple):
    group: WorkerGroup
    address: str  # the Ray the actors live in


_KEPT: list = []  # Kept groups, the one kept longest ago first


def reuse_enabled() -> bool:
    return os.environ.get(REUSE_ENV, "").strip().lower() in ("1", "true", "yes")


def _address() -> str:
    """This driver's Ray session: the cluster's address, the driver's node and its job (a driver that
    reconnects is a new job, whose kept actors died with the old one)."""
    import ray

    if not ray.is_initialized():
        return ""
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_node_id()}/{context.get_job_id()}"


def kept_max() -> int:
    """``RAYRL_KEPT_MAX``, else ``KEPT_MAX``: the most actors kept at once."""
    value = os.environ.get(KEPT_MAX_ENV, "").strip()
    if not value:
        return KEPT_MAX
    if not value.isdigit():
        raise ValueError(f"{KEPT_MAX_ENV}={value!r}: give a whole number of actors (0 or more)")
    return int(value)


def held(shape) -> dict:
    """The resources a kept group of ``shape`` holds in its placement group: its bundle, once per actor."""
    return {key: amount * shape.size for key, amount in shape.bundle}


def fits(need: dict, free: dict) -> bool:
    return all(free.get(key, 0.0) >= amount - 1e-9 for key, amount in need.items())


def to_free(holding: Sequence[dict], need: dict, free: dict) -> list:
    """Which kept groups (indices into ``holding``, the resources each holds, the one kept longest ago
    first) must go before bundles needing ``need`` in all fit in ``free`` (what the Ray has free now):
    oldest first, each only if it holds something still short; every one where even all of them would
    not make the room."""
    room, chosen = dict(free), list[int]()
    for i, held_here in enumerate(holding):
        if fits(need, room):
            return chosen
        if any(room.get(key, 0.0) < need.get(key, 0.0) - 1e-9 and held_here.get(key, 0.0) > 0 for key in need):
            chosen.append(i)
            for key, amount in held_here.items():
                room[key] = room.get(key, 0.0) + amount
    return chosen if fits(need, room) else list(range(len(holding)))


def keepable(group: WorkerGroup) -> bool:
    """A group the next cluster could take whole: a kept role, every actor in its own placement group's
    bundle (none added while the run grew or repaired it), and as many actors as bundles (not shrunk)."""
    pg = group.placement_group
    return (group.role in KEPT_ROLES and group.shape is not None and not any(s is not None for s in group.slots)
            and pg is not None and group.size == group.shape.size == pg.bundle_count)


def free_groups(groups: Sequence, timeout_s: float = RELEASE_S, keep: bool = True) -> int:
    """At a cluster's end: with ``keep`` and ``RAYRL_REUSE_ACTORS`` on, each group that is ``keepable``
    and whose actors all let go of their job in time (asked together, waited for up to ``timeout_s``)
    is kept for the next cluster; every other group is killed. Returns how many actors were kept."""
    keeping = [g for g in groups if keep and reuse_enabled() and keepable(g)]
    asked = [(g, fan_out(g, "release")) for g in keeping]
    kept, before = 0, len(_KEPT)
    for group in groups:
        calls = next((c for g, c in asked if g is group), None)
        if calls is not None:
            try:
                if all(gather(calls, timeout_s)):
                    _KEPT.append(Kept(group, _address()))
                    kept += group.size
                    continue
            except Exception:  # dead, stuck or raising: not kept
                pass
        kill_group(group)
    # past the limits the groups kept longest ago go first; this cluster's own stay whole, as the likeliest next
    while before > 0 and (kept_count() > kept_max() or 2 * _kept_cpus() > _ray_cpus()):
        kill_group(_KEPT.pop(0).group)
        before -= 1
    return kept


def _kept_cpus() -> float:
    return sum(held(k.group.shape).get("CPU", 0.0) for k in _KEPT)


def _ray_cpus() -> float:
    """The Ray's CPUs: kept groups hold at most half, the rest is for actors started outside a
    cluster (a test's, a user's own), which no kept group makes room for."""
    import ray

    return ray.cluster_resources().get("CPU", 0.0) if ray.is_initialized() else 0.0


def release_unclaimed(need: Optional[dict] = None) -> int:
    """Kill the kept groups no role took (in the Ray this driver is connected to; those of a Ray that
    has gone are forgotten): every one, or with ``need`` (the resources of the bundles a new cluster
    is about to ask for) those ``to_free`` names, none where nothing is needed, all of them on a Ray
    of several nodes. Returns how many actors it killed."""
    here = _address()
    _KEPT[:] = [k for k in _KEPT if here and k.address == here]
    going = list(range(len(_KEPT)))
    if need is not None and _KEPT:
        import ray

        if not any(need.values()):
            going = []
        elif len([n for n in ray.nodes() if n.get("Alive")]) == 1:
            going = to_free([held(k.group.shape) for k in _KEPT], need, ray.available_resources())
    killed = 0
    for i in reversed(going):
        kill_group(_KEPT[i].group)
        killed += _KEPT.pop(i).group.size
    return killed


def make_room(specs: Sequence[RoleSpec], wait_s: float = 10.0) -> int:
    """Before new bundles of ``specs`` are asked for (a cluster's roles, its critics, generators added
    while it runs): free the kept groups of other shapes that make room for those bundles
    (``release_unclaimed``), and give Ray up to ``wait_s`` to count what was freed
    (by this, or by a kept group that failed to rebuild) before the caller checks or asks. Returns how
    many actors it killed."""
    import time

    import ray

    need = total_request(specs)
    killed = release_unclaimed(need)
    deadline = time.monotonic() + wait_s
    while not fits(need, ray.available_resources()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def kept_count() -> int:
    """Actors waiting for the next cluster."""
    return sum(k.group.size for k in _KEPT)


class Wanted(NamedTuple):
    """A role a new cluster asks for: its actor class, spec, keywords per rank, and a generator's engine."""

    actor_cls: type
    spec: RoleSpec
    make_kwargs: Callable[[int], dict]
    variant: str = ""


def start_groups(wanted: dict, timeout_s: float, check: Optional[Callable] = None) -> tuple:
    """``({role: WorkerGroup}, [roles rebuilt from kept actors])``: each role a kept group of its shape
    serves is rebuilt there (every role's actors at once, then waited for); any that failed to
    rebuild are freed, and the oldest of the kept groups left as far as the new bundles need
    (``make_room``); the other roles get new placement groups (requested together) and new actors
    (a role whose kept group failed gets new ones: their error, if any, names the cause). ``check``,
    given, is called with the new roles' specs once the room is made, before they are asked for."""
    here = _address() if reuse_enabled() else None
    if here is not None:
        kept_max()  # a bad RAYRL_KEPT_MAX is named now, not at the end of the job
    rebuilding: dict = {}  # role -> (kept group, its rebuild calls)
    for name, w in wanted.items():
        shape = group_shape(w.actor_cls, w.spec, w.variant)
        match = next((k for k in _KEPT if here and k.group.shape == shape and k.address == here), None)
        if name in KEPT_ROLES and match is not None:
            _KEPT.remove(match)
            rebuilding[name] = (match.group, [Call(a.rebuild.remote(**w.make_kwargs(r)), name, r, "rebuild",
                                                   actor_id(a)) for r, a in enumerate(match.group.actors)])
    groups: dict = {}
    for name, (group, calls) in rebuilding.items():
        try:
            gather(calls, timeout_s)
            groups[name] = group
        except Exception:  # a kept actor that died or cannot rebuild: the role starts anew
            kill_group(group)
    reused = list(groups)
    fresh = [w.spec for name, w in wanted.items() if name not in groups]
    try:
        make_room(fresh)
        if check is not None and fresh:
            check(fresh)
        pgs = create_placement_groups(fresh, timeout_s) if fresh else {}  # room may take a pod's start
    except BaseException:
        for group in groups.values():  # the rebuilt groups no cluster will hold
            kill_group(group)
        raise
    for name, w in wanted.items():
        if name not in groups:
            groups[name] = create_group(w.actor_cls, w.spec, pgs[w.spec.name], w.make_kwargs, w.variant)
    return groups, reused
