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

Only the last cluster's actors wait: a cluster that does not take a kept group frees it (kills its
actors, removes its placement group) before it asks for its own bundles, so kept actors never
hold resources a new cluster needs. Critics are not kept (they start after the other roles, which
have freed what no role took by then), nor a vLLM generator (``reusable``), nor a group grown,
shrunk or repaired into a placement group of its own while it ran, nor an actor that does not let
go of its job in time, nor anything of a run that failed.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Sequence

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
KEPT_ROLES = ("trainer", "generator", "reward", "reference")  # critics start late (add_critics), not kept


class Kept(NamedTuple):
    group: WorkerGroup
    address: str  # the Ray the actors live in


_KEPT: list = []  # Kept groups, from the last cluster that shut down


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
    kept = 0
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
    return kept


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
    serves is rebuilt there (every role's actors at once, then waited for); the kept groups left,
    and any that failed to rebuild, are freed; the other roles get new placement groups (requested
    together) and new actors (a role whose kept group failed gets new ones: their error, if any,
    names the cause)."""
    here = _address() if reuse_enabled() else None
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
    release_unclaimed()
    fresh = [w.spec for name, w in wanted.items() if name not in groups]
    pgs = create_placement_groups(fresh) if fresh else {}
    for name, w in wanted.items():
        if name not in groups:
            groups[name] = create_group(w.actor_cls, w.spec, pgs[w.spec.name], w.make_kwargs, w.variant)
    return groups, reused
