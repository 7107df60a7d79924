"""Actors kept for the driver's next cluster of the same shape (``RAYRL_REUSE_ACTORS=1``).

A trainer, generator or reference actor spends most of its start importing torch, transformers
and DeepSpeed (6-8 s of CPU per process); a job of a few steps on a small model spends less than
that on its steps. A driver that runs many such jobs one after the other (a sweep, a notebook,
the test suite) can keep the actors of one cluster for the next: at shutdown each kept actor
drops its job (``rl_actors.reuse.Reusable.release``: models, engines, process groups) and waits
in its placement group; the next cluster whose role has the same actor class, count, bundle and
strategy rebuilds those actors with its own keywords (``rebuild``) instead of starting new
processes. A rebuilt actor computes what a new one would (the tests compare runs on kept and on
new actors); what it keeps is its imports, and its Ray actor id.

Only the last cluster's actors wait: a cluster that does not take a kept group frees it (kills its
actors, removes its placement group) before it asks for its own bundles, so kept actors never
hold resources a new cluster needs. Reward workers and critics are not kept (they start cheaply
or late), nor a vLLM generator (``reusable``), nor a group grown or repaired while it ran (an actor
in a placement group of its own), nor an actor that does not answer its release in time.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional

from cluster.loop.protocol import ActorFailure
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
from cluster.ray_wing.placement import RoleSpec, create_placement_groups

REUSE_ENV = "RAYRL_REUSE_ACTORS"  # "1": keep the actors of each cluster for the next of the same shape
RELEASE_S = 30.0  # an actor that has not dropped its job by then is killed, not kept
KEPT_ROLES = ("trainer", "generator", "reference")  # reward workers start in about a second; critics come late


class Kept(NamedTuple):
    group: WorkerGroup
    address: str  # the Ray the actors live in


_KEPT: list = []  # Kept groups, from the last cluster that shut down


def reuse_enabled() -> bool:
    return os.environ.get(REUSE_ENV, "").strip().lower() in ("1", "true", "yes")


def _address() -> str:
    """This driver's Ray, told apart from an earlier one at the same address by the driver's node id."""
    import ray

    if not ray.is_initialized():
        return ""
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_node_id()}"


def free_group(group: WorkerGroup, timeout_s: float = RELEASE_S) -> bool:
    """At a cluster's end: keep ``group`` for the next cluster (``RAYRL_REUSE_ACTORS``) if its role is
    kept and every actor releases its job in time; else kill it. Returns whether it was kept."""
    kept = False
    if reuse_enabled() and group.role in KEPT_ROLES and group.shape and not any(s is not None for s in group.slots):
        try:
            kept = all(gather(fan_out(group, "release"), timeout_s))
        except ActorFailure:
            kept = False
    if kept:
        _KEPT.append(Kept(group, _address()))
    else:
        kill_group(group)
    return kept


def take(shape: tuple, make_kwargs: Callable[[int], dict], timeout_s: float) -> Optional[WorkerGroup]:
    """A kept group of ``shape``, each actor rebuilt with ``make_kwargs(rank)``; None when there is
    none, or it failed to rebuild (it is killed: a new group's error names the cause)."""
    here = _address()
    for i, kept in enumerate(_KEPT):
        if kept.group.shape == shape and kept.address == here:
            del _KEPT[i]
            try:
                gather([Call(a.rebuild.remote(**make_kwargs(r)), kept.group.role, r, "rebuild", actor_id(a))
                        for r, a in enumerate(kept.group.actors)], timeout_s)
            except ActorFailure:
                kill_group(kept.group)
                return None
            return kept.group
    return None


def release_unclaimed() -> int:
    """Kill every kept group no role took (in the Ray this driver is connected to; those of a Ray
    that has gone are forgotten). Returns how many actors it killed."""
    here, killed = _address(), 0
    while _KEPT:
        kept = _KEPT.pop()
        if here and kept.address == here:
            kill_group(kept.group)
            killed += kept.group.size
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


def start_groups(wanted: dict, timeout_s: float) -> tuple:
    """``({role: WorkerGroup}, [roles rebuilt from kept actors])``: each role a kept group of its shape
    serves is rebuilt there; the kept groups left are freed; the other roles get new placement groups
    (requested together) and new actors."""
    groups: dict = {}
    for name, w in wanted.items():
        if reuse_enabled() and name in KEPT_ROLES:
            groups[name] = take(group_shape(w.actor_cls, w.spec, w.variant), w.make_kwargs, timeout_s)
    reused = [name for name, g in groups.items() if g is not None]
    release_unclaimed()
    fresh = [w.spec for name, w in wanted.items() if groups.get(name) is None]
    pgs = create_placement_groups(fresh) if fresh else {}
    for name, w in wanted.items():
        if groups.get(name) is None:
            groups[name] = create_group(w.actor_cls, w.spec, pgs[w.spec.name], w.make_kwargs, w.variant)
    return groups, reused
