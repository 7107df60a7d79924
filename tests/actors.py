"""Trainer and critic rank processes kept from test to test, for the modules that build rank groups
themselves (1 rank against N, ZeRO stages, LoRA): a new rank spends 6-8 s of CPU importing torch,
transformers and DeepSpeed, more than most of these tests spend on their step.

``start_ranks`` takes an idle group of the class and size when there is one and rebuilds its ranks
with the new arguments (``rl_actors.reuse.Reusable.rebuild``: the constructor again, in the same
process, as the job pool does, ``cluster.ray_wing.pool``), else starts new ones; ``done`` lets the
group go of its job (``release``) and keeps it idle, or kills it when it cannot (dead, stuck). A rebuilt rank computes
what a new one does (``tests/cluster/test_kept_actors.py``, ``tests/rl_actors/test_reusable.py``);
a test of what a new process reads back (a resume, a restore) asks for ``fresh`` ones.

Idle ranks reserve no logical CPU (``num_cpus=0``: a later job's placement groups never wait for
them) and at most ``MAX_IDLE`` wait; a Ray that shut down takes its idle ranks with it."""
from __future__ import annotations

import inspect

MAX_IDLE = 6  # idle ranks kept, in whole groups (each holds its imports' memory)
RELEASE_S = 60.0
_IDLE: list = []  # (Ray session, actor class, the group's handles in rank order), oldest first
_CLASS: dict = {}  # actor id -> the class start_ranks made it of


def _session(ray) -> str:
    context = ray.get_runtime_context()
    return f"{context.gcs_address}/{context.get_job_id()}"


def _keywords(cls, args: tuple, kwargs: dict) -> dict:
    """``cls(*args, **kwargs)``'s arguments by name, as ``rebuild`` takes them."""
    bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    return {name: value for name, value in list(bound.arguments.items())[1:]}


def start_ranks(ray, cls, calls: list, fresh: bool = False) -> list:
    """One actor of ``cls`` per ``(args, kwargs)`` in ``calls``, each as ``cls(*args, **kwargs)``
    starts: an idle group of as many ranks, rebuilt (unless ``fresh``), or new ones. Groups are kept
    and reused whole, as the job pool keeps them: two kept ranks of different histories (LoRA and
    ZeRO-3 jobs, a snapshot restore) in one ZeRO-2 group once logged a gradient norm 1.4 % off the
    one-process value, and the product never puts such ranks together (``cluster.ray_wing.pool``
    keeps whole groups; recovery starts every rank anew).
    Not set up: ``rendezvous`` does that."""
    session = _session(ray)
    _IDLE[:] = [idle for idle in _IDLE if idle[0] == session]  # an earlier Ray's are gone
    match = None if fresh else next((idle for idle in _IDLE if idle[1] is cls and len(idle[2]) == len(calls)), None)
    if match is not None:
        _IDLE.remove(match)
        actors = list(match[2])
        try:
            ray.get([a.rebuild.remote(**_keywords(cls, *call)) for a, call in zip(actors, calls)], timeout=300)
            return actors
        except Exception:  # a group that cannot rebuild: new ranks
            kill(ray, actors)
    remote = ray.remote(num_cpus=0)(cls)
    actors = [remote.remote(*args, **kwargs) for args, kwargs in calls]
    _CLASS.update({a._actor_id.hex(): cls for a in actors})
    return actors


def rendezvous(ray, actors: list) -> list:
    """Set the group up: rank 0's endpoint, then every rank's ``setup`` together. Their infos."""
    address = ray.get(actors[0].endpoint.remote())
    return ray.get([a.setup.remote(*address) for a in actors], timeout=300)


def done(ray, actors: list) -> None:
    """The group lets go of its job and waits for the next test, whole (the oldest idle groups are
    killed beyond ``MAX_IDLE`` ranks); a group with a rank dead, stuck or refusing is killed."""
    try:
        kept = all(ray.get([a.release.remote() for a in actors], timeout=RELEASE_S))
    except Exception:
        kept = False
    if not kept:
        kill(ray, actors)
        return
    _IDLE.append((_session(ray), _CLASS[actors[0]._actor_id.hex()], tuple(actors)))
    while sum(len(idle[2]) for idle in _IDLE) > MAX_IDLE:
        kill(ray, _IDLE.pop(0)[2])


def kill(ray, actors) -> None:
    for actor in actors:
        ray.kill(actor)
