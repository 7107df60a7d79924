"""Create N actors of a role in its placement group; fan calls out and get refs back.

Calls return ``Call``s (a ref and who computes it) without blocking; ``gather`` is the one
place that waits - always with a bound - and turns a dead, raising or silent actor into
an ``ActorFailure`` that names its role and rank. The driver decides when to gather.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from cluster.loop.protocol import ActorFailure
from cluster.ray_wing.placement import RoleSpec


class WorkerGroup(NamedTuple):
    """``role``'s actors, one per bundle of its placement group; an actor added later (a
    generator group grown while running) sits in a placement group of its own (``slots``)."""

    role: str
    actors: tuple
    placement_group: Any = None
    slots: tuple = ()  # per rank: (placement group, bundle) of an added actor, None for the group's own bundle
    shape: Optional["GroupShape"] = None  # of its actor class and role (cluster.ray_wing.pool keeps groups by it)

    @property
    def size(self) -> int:
        return len(self.actors)

    def slot(self, rank: int) -> tuple:
        """``(placement group, bundle index)`` that actor ``rank`` is pinned to."""
        own = self.slots[rank] if rank < len(self.slots) else None
        return own if own is not None else (self.placement_group, rank)


class RoleFactory(NamedTuple):
    """How to make one more actor of a role (a replacement, or an added generator)."""

    actor_cls: type
    spec: RoleSpec
    make_kwargs: Callable[[int], dict]  # rank -> the actor's keywords

    def create(self, rank: int, placement_group, bundle: int):
        return create_actor(self.actor_cls, self.spec, placement_group, rank, self.make_kwargs, bundle)


class Call(NamedTuple):
    ref: Any  # ray.ObjectRef
    role: str
    rank: int
    method: str
    actor_id: str = ""  # the actor's id (hex): a death reported with another id is of an actor the call read from


def create_actor(actor_cls, spec: RoleSpec, placement_group, rank: int, make_kwargs: Callable[[int], dict],
                 bundle: Optional[int] = None):
    """One actor of ``actor_cls`` built from the keywords ``make_kwargs(rank)``, pinned to bundle
    ``bundle`` (default: ``rank``) of ``placement_group``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    kwargs = make_kwargs(rank)
    options = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=spec.resources or None,
                   max_restarts=0, max_concurrency=1,
                   scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                                        rank if bundle is None else bundle))
    return ray.remote(actor_cls).options(**options).remote(**kwargs)


class GroupShape(NamedTuple):
    """What another group must match to stand in for one (``group_shape``)."""

    actor_cls: str  # module.qualname
    role: str
    size: int  # actors, one per bundle
    bundle: tuple  # sorted (resource, amount) pairs
    strategy: str
    variant: str  # a generator's engine


def group_shape(actor_cls: type, spec: RoleSpec, variant: str = "") -> GroupShape:
    """Actor class, role, count, bundle, placement strategy, and ``variant`` (a generator's engine)."""
    return GroupShape(f"{actor_cls.__module__}.{actor_cls.__qualname__}", spec.name, spec.count,
                      tuple(sorted(spec.bundle().items())), spec.strategy, variant)


def create_group(actor_cls, spec: RoleSpec, placement_group, make_kwargs: Callable[[int], dict],
                 variant: str = "") -> WorkerGroup:
    """``spec.count`` actors of ``actor_cls``; rank r is built from the keywords
    ``make_kwargs(r)`` and pinned to bundle r of the placement group."""
    actors = [create_actor(actor_cls, spec, placement_group, r, make_kwargs) for r in range(spec.count)]
    return WorkerGroup(spec.name, tuple(actors), placement_group, shape=group_shape(actor_cls, spec, variant))


def actor_id(actor) -> str:
    """The Ray actor id of a handle, as Ray's errors name it (hex)."""
    return actor._actor_id.hex()


def call(group: WorkerGroup, rank: int, method: str, *args, **kwargs) -> Call:
    actor = group.actors[rank]
    return Call(getattr(actor, method).remote(*args, **kwargs), group.role, rank, method, actor_id(actor))


def call_split(group: WorkerGroup, rank: int, method: str, *args) -> tuple:
    """``(Call of the first result, ref of the second)`` of a method that returns two values
    (a summary the driver fetches, and data it leaves in the object store)."""
    actor = group.actors[rank]
    first, second = getattr(actor, method).options(num_returns=2).remote(*args)
    return Call(first, group.role, rank, method, actor_id(actor)), second


def fan_out(group: WorkerGroup, method: str, *args, **kwargs) -> list:
    """The same call on every actor of the group."""
    return [call(group, r, method, *args, **kwargs) for r in range(group.size)]


def fan_out_each(group: WorkerGroup, method: str, per_rank_args: Sequence[tuple]) -> list:
    """Actor r gets ``*per_rank_args[r]``; ranks with no arguments (None) are skipped."""
    return [call(group, r, method, *a) for r, a in enumerate(per_rank_args) if a is not None]


def split_evenly(items: Sequence, parts: int) -> list:
    """Contiguous, near-equal chunks (sizes differ by at most one; some may be empty)."""
    n = len(items)
    return [list(items[(n * i) // parts: (n * (i + 1)) // parts]) for i in range(parts)]


def kill_actor(actor) -> None:
    """Kill ``actor`` (a stuck one too: Ray ends its process), if it is not gone already, and drop
    its heartbeat count from Ray's key-value store (a long-lived cluster would gather one per
    actor ever started)."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_del

    from rl_actors.common import HEARTBEAT_KEY

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
    try:
        _internal_kv_del((HEARTBEAT_KEY + actor_id(actor)).encode())
    except Exception:  # Ray going down: nothing left to keep clean
        pass


def kill_group(group: WorkerGroup) -> None:
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        kill_actor(actor)
    added = [slot[0] for slot in group.slots if slot is not None]
    for pg in ([group.placement_group] if group.placement_group is not None else []) + added:
        remove_placement_group(pg)


TRANSFER_S = 120.0  # at least this long to fetch a finished result from another node's object store
CHECK_S = 5.0  # while waiting for calls, their actors' heartbeats are read this often


class Heartbeats:
    """The driver's view of its actors' heartbeats (``rl_actors.common.start_heartbeat``): when, by
    the driver's clock, each actor's count last moved. An actor whose count has not moved for
    ``stale_s`` is stopped or hung, whatever its call's timeout; one with no count yet (still
    starting, or an actor class without one) is left to the call timeout. ``stale_s`` 0: off."""

    def __init__(self, stale_s: float = 45.0, read: Optional[Callable] = None, clock: Callable = time.monotonic):
        self.stale_s, self.read, self.clock = stale_s, read or _read_heartbeats, clock
        self.seen: dict = {}  # actor id -> (count, driver time it was first seen at that count)

    def stale(self, actor_ids) -> set:
        """Those of ``actor_ids`` whose count has not moved for ``stale_s`` (seen from here)."""
        if self.stale_s <= 0 or not actor_ids:
            return set()
        now, counts, out = self.clock(), self.read(sorted(set(actor_ids))), set()
        for actor, count in counts.items():
            seen = self.seen.get(actor)
            if count is None:
                continue
            if seen is None or seen[0] != count:
                self.seen[actor] = (count, now)
            elif now - seen[1] >= self.stale_s:
                out.add(actor)
        return out


def _read_heartbeats(actor_ids: Sequence[str]) -> dict:
    from ray.experimental.internal_kv import _internal_kv_get

    from rl_actors.common import HEARTBEAT_KEY

    out = {}
    for actor in actor_ids:
        try:
            raw = _internal_kv_get((HEARTBEAT_KEY + actor).encode())
        except Exception:
            raw = None
        out[actor] = int(raw) if raw else None
    return out


HEARTBEATS = Heartbeats()  # this driver's; build_rl_cluster sets its bound from cluster.heartbeat_s


def watch_heartbeats(stale_s: float) -> None:
    """Take an actor whose heartbeat has not moved for ``stale_s`` seconds for stuck (0: only the
    call timeout finds a stuck actor)."""
    HEARTBEATS.stale_s = float(stale_s)


def wait_next(pending: list, by_ref: dict, deadline: float) -> tuple:
    """``ray.wait`` for the next of the ``pending`` refs (of the calls ``by_ref``) to finish, until
    ``deadline`` (``time.monotonic()``): ``(ready, still pending)``, nothing fetched. Every
    ``CHECK_S`` meanwhile, the heartbeats of the pending calls' actors are read: a call whose actor's
    heartbeat stopped fails at once, as stuck, naming that actor alone (its peers, waiting for it in
    a collective, beat on)."""
    import ray

    while True:
        left = deadline - time.monotonic()
        ready, rest = ray.wait(pending, num_returns=1, timeout=max(0.0, min(left, CHECK_S)), fetch_local=False)
        if ready or left <= CHECK_S:
            return ready, rest
        stopped = HEARTBEATS.stale({by_ref[r].actor_id for r in rest if by_ref[r].actor_id})
        late = [by_ref[r] for r in rest if by_ref[r].actor_id in stopped]
        if late:
            names = ", ".join(f"{c.role} {c.rank}.{c.method}" for c in late)
            raise ActorFailure(f"no heartbeat for {HEARTBEATS.stale_s:.0f}s from: {names} (the process is stopped or "
                               "hung; cluster.heartbeat_s)", late[0].role, late[0].rank, stuck=True,
                               late=tuple(dict.fromkeys((c.role, c.rank) for c in late)))


def gather(calls: Sequence[Call], timeout_s: float, waited_s: Optional[float] = None) -> list:
    """``ray.get`` of every call, bounded by ``timeout_s``; errors name the actor. A dead actor
    fails it at once; calls unanswered after ``timeout_s`` fail it as stuck (``waited_s``: the
    wait to report, when the calls were waited for before, elsewhere). Once every call has
    answered, its result may still have to come from another node: that transfer has its own
    bound (the larger of ``timeout_s``, ``waited_s`` and ``TRANSFER_S``), so ``timeout_s=0``
    means "already waited for", never "the result must be here already"."""
    _wait_all(calls, timeout_s, waited_s)
    return [_value(c, max(timeout_s, waited_s or 0.0, TRANSFER_S)) for c in calls]


def settle(calls: Sequence[Call], timeout_s: float, waited_s: Optional[float] = None) -> None:
    """Waits (at most ``timeout_s``) for every call to answer and raises the ``ActorFailure`` of
    the first that died, raised or did not answer, as ``gather`` would, without fetching any
    result: a finished result that lives on another node stays there."""
    _wait_all(calls, timeout_s, waited_s)
    for c in calls:
        failure = _failure(c)
        if failure is not None:
            raise failure


def _wait_all(calls: Sequence[Call], timeout_s: float, waited_s: Optional[float]) -> None:
    """Until every call has answered: a dead actor, or one whose heartbeat stopped, fails the wait
    at once; calls unanswered after ``timeout_s`` fail it as stuck (a rank that raised first is
    named instead: its peers wait for it in a collective)."""
    by_ref = {c.ref: c for c in calls}
    pending, deadline = list(by_ref), time.monotonic() + timeout_s
    while pending:  # a dead actor fails the wait at once: its peers may wait for it in a collective
        ready, pending = wait_next(pending, by_ref, deadline)
        if not ready:
            late = [c for c in calls if c.ref in set(pending)]
            for c in calls:  # a rank that raised leaves its peers waiting in a collective: the error is its
                failure = _failure(c) if c.ref not in set(pending) else None
                if failure is not None and not failure.died:
                    raise failure
            names = ", ".join(f"{c.role} {c.rank}.{c.method}" for c in late)
            raise ActorFailure(f"no answer within {waited_s or timeout_s:.0f}s from: {names} (stuck or too slow; "
                               f"raise cluster.call_timeout_s if the work is simply long, cluster.start_timeout_s "
                               f"if starting is)", late[0].role, late[0].rank,
                               stuck=True, late=tuple(dict.fromkeys((c.role, c.rank) for c in late)))
        died = _died(by_ref[ready[0]])
        if died is not None:
            raise died


def _value(c: Call, transfer_s: float):
    """The result of a call that has answered, fetched here within ``transfer_s``."""
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    try:
        return ray.get(c.ref, timeout=transfer_s)
    except RayActorError as e:
        raise _death(c, e) from e
    except (RayTaskError, ObjectLostError) as e:
        raise _raised(c, e) from e
    except GetTimeoutError as e:
        raise ActorFailure(f"{c.role} {c.rank}.{c.method}: its result did not arrive within {transfer_s:.0f}s",
                           c.role, c.rank, stuck=True) from e


def _failure(c: Call) -> Optional[ActorFailure]:
    """The failure of a call that has answered (its actor died, or its method raised); None when
    it returned a value, here or on another node (that value is not fetched)."""
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    try:  # an error is small and kept by the caller; a large value on another node times out at once
        ray.get(c.ref, timeout=0)
    except RayActorError as e:
        return _death(c, e)
    except (RayTaskError, ObjectLostError) as e:
        return _raised(c, e)
    except GetTimeoutError:
        return None
    return None


def _raised(c: Call, error) -> ActorFailure:
    """A call that raised, or whose result or argument was lost with the node that stored it."""
    from ray.exceptions import ObjectLostError

    if isinstance(error, ObjectLostError):
        return lost_object(c.role, c.rank, c.method, error)
    cause = error.as_instanceof_cause() if hasattr(error, "as_instanceof_cause") else error
    return ActorFailure(f"{c.role} {c.rank} failed in {c.method}: {cause}", c.role, c.rank)


def lost_object(role: str, rank: int, method: str, error) -> ActorFailure:
    """The failure of ``role rank.method`` whose result, or an argument it read, was lost with the
    node that stored it (``ray.exceptions.ObjectLostError``; inside the call when an argument was
    lost). The node's actors are gone: the failure names the actor that made the lost object (its
    id is inside the object's: task id = 8 unique bytes + actor id), so that actor is replaced
    (unless it was already) and its work is done again. A fetch that timed out is a slow call
    (stuck), not a loss; an object freed or miscounted, or one whose maker cannot be told, is a
    fault of the run's bookkeeping that no replacement mends (final)."""
    from ray.exceptions import ObjectFetchTimedOutError, ObjectFreedError, ReferenceCountingAssertionError

    hex_id = getattr(error, "object_ref_hex", "") or ""
    if not hex_id and getattr(error, "cause", None) is not None:  # raised inside a call whose argument was lost
        hex_id = getattr(error.cause, "object_ref_hex", "") or ""
    where = f"{role} {rank}.{method}: object {hex_id[:16] or '?'}..."
    if isinstance(error, ObjectFetchTimedOutError):
        return ActorFailure(f"{where} was not fetched in time from the node that stores it", role, rank, stuck=True)
    maker = hex_id[16:48] if len(hex_id) == 56 else ""
    if isinstance(error, (ObjectFreedError, ReferenceCountingAssertionError)) or not maker:
        return ActorFailure(f"{where} is gone and cannot be made again ({type(error).__name__})", role, rank, True,
                            final=True)
    return ActorFailure(f"{where} was lost with the node that stored it; the actor that made it is replaced and its "
                        "work done again", role, rank, True, actor_id=maker)


def first_death(calls: Sequence[Call]) -> Optional[ActorFailure]:
    """The failure of the first of ``calls`` that has finished because its actor (or one whose
    result it read) died; None when none has, without waiting for any."""
    import ray

    refs = [c.ref for c in calls]
    if not refs:
        return None
    done = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0])
    return next((d for d in (_died(c) for c in calls if c.ref in done) if d is not None), None)


def _died(c: Call) -> Optional[ActorFailure]:
    """The failure of a finished call whose actor died (None otherwise), without fetching its
    result: an actor's death is reported as its call's error, which is small."""
    failure = _failure(c)
    return failure if failure is not None and failure.died else None


def _death(c: Call, error) -> ActorFailure:
    """The ``ActorFailure`` of a call that failed with an actor's death: its own actor's, or
    (another actor id in the error) that of an actor whose result it read, which the failure
    then names by id (the backend knows its role)."""
    dead = getattr(error, "actor_id", None) or ""
    if dead and c.actor_id and dead != c.actor_id:
        return ActorFailure(f"{c.role} {c.rank}.{c.method}: an actor whose result it read died: {_cause(error)}",
                            c.role, c.rank, True, actor_id=dead)
    return ActorFailure(f"{c.role} {c.rank} died during {c.method}: {_cause(error)}", c.role, c.rank, True,
                        actor_id=dead)


def _cause(error: Exception) -> str:
    """The most specific error line in a Ray actor failure (e.g. the constructor's exception)."""
    lines = [ln.strip() for ln in str(error).splitlines() if "Error: " in ln or "Exception: " in ln]
    return lines[-1] if lines else error.__class__.__name__
