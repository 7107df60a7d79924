"""The order a recovery replaces actors in, and what it records, without Ray (the cluster's
replace and rebuild steps stand in): single actors before DeepSpeed groups; a recovery cut by
another failure goes on from the step it was cut in, its record marked ``cut``; one that fails for
good is recorded ``failed``."""
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.loop.protocol import ActorFailure
from cluster.ray_wing import recovery as recovery_module
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import WorkerGroup
from cluster.ray_wing.handles import GeneratorWorkers, ReferenceWorkers
from cluster.ray_wing.recovery import _single_actors_first
from cluster.ray_wing.roles import RLCluster
from rl_actors.weight_sync import SyncAddress

ROLES = ("trainer", "critic", "generator", "reward", "reference")


class _Reference:
    def __init__(self, where: str):
        self.where = where


@given(st.lists(st.tuples(st.sampled_from(ROLES), st.integers(0, 3)), max_size=8),
       st.sampled_from([None, "workers", "trainers"]))
def test_single_actors_come_before_groups_in_their_own_order(targets, reference):
    ordered = _single_actors_first(targets, _Reference(reference) if reference else None)
    on_trainers = reference == "trainers"
    named = [("trainer" if r == "reference" and on_trainers else r, k) for r, k in targets]
    assert sorted(ordered) == sorted(named)  # the same targets, a reference on the trainers named as theirs
    groups = [t[0] in ("trainer", "critic") for t in ordered]
    assert groups == sorted(groups)  # no single actor after a group
    assert [t for t in ordered if t[0] not in ("trainer", "critic")] == [  # each kind keeps its order
        t for t in named if t[0] not in ("trainer", "critic")]
    assert [t for t in ordered if t[0] in ("trainer", "critic")] == [t for t in named if t[0] in ("trainer", "critic")]


def test_a_stopped_generator_beside_trainer_rank_0_in_a_broadcast_is_replaced_first():
    """The timeout of a sync names trainer 0 (blocked in the broadcast) before the generator that
    stopped; the generator is replaced before the trainer group is rebuilt."""
    assert _single_actors_first([("trainer", 0), ("generator", 0)], None) == [("generator", 0), ("trainer", 0)]


def _backend(monkeypatch, dead=(), generators=("g0",), born_dead=False, reference=False) -> tuple:
    """A backend over a cluster of named stand-in actors; ``dead`` names those that are dead. Forming
    the weight-sync group fails on the first dead member (as a gather does), a swap puts a new name
    in the old one's place (dead too with ``born_dead``), a rebuild renames every trainer rank, a
    weight sync and a reference worker's restore are recorded. ``reference``: a tracking reference
    worker ``r0``, in the sync group."""
    tracking = ReferenceWorkers(WorkerGroup("reference", ("r0",)), tracks=True)
    cluster = RLCluster(generators=GeneratorWorkers(WorkerGroup("generator", tuple(generators))),
                        trainers=WorkerGroup("trainer", ("t0", "t1")), rewards=None,
                        reference=tracking if reference else None,
                        sync_address=SyncAddress("", 0, 0, "gloo"), weight_meta=(), pad_token_id=0, bucket_bytes=0,
                        timeout_s=60, ray_address="")
    dead, calls = set(dead), []

    def renamed(group, rank):
        actors = list(group.actors)
        actors[rank] += "'"
        if born_dead:
            dead.add(actors[rank])
        return group._replace(actors=tuple(actors))

    def rebuild(c, role):
        calls.append(("rebuild", role))
        if role == "critic":
            return c
        return c._replace(trainers=c.trainers._replace(actors=tuple(a + "'" for a in c.trainers.actors)))

    def swap(c, role, rank):
        calls.append(("swap", role, rank))
        if role == "reference":
            return c._replace(reference=c.reference._replace(group=renamed(c.reference.group, rank)))
        return c._replace(generators=GeneratorWorkers(renamed(c.generators.group, rank)))

    def join(c):
        for group in (c.trainers, c.generators.group) + ((c.reference.group,) if c.reference else ()):
            for rank, actor in enumerate(group.actors):
                if actor in dead:
                    calls.append(("join failed on", group.role, rank))
                    raise ActorFailure(f"{group.role} {rank} died during init_weight_sync", group.role, rank, died=True)
        calls.append(("joined",))
        return c._replace(sync_address=c.sync_address._replace(token=f"formed {len(calls)}"))  # each forming anew

    monkeypatch.setattr(recovery_module, "rebuild_group", rebuild)
    monkeypatch.setattr(recovery_module, "swap_actor", swap)
    monkeypatch.setattr(recovery_module, "join_weight_sync", join)
    monkeypatch.setattr(RayBackend, "_restore_groups", lambda self: calls.append(("restore",)))
    monkeypatch.setattr(recovery_module, "sync_weights", lambda c, version, **kw: calls.append(("sync",)))
    monkeypatch.setattr(recovery_module, "call", lambda group, rank, method, *a: (group.actors[rank], method))
    monkeypatch.setattr(recovery_module, "gather", lambda cs, timeout_s: [calls.append(c) for c in cs])
    backend = RayBackend(cluster, max_actor_restarts=5)
    backend.snapshot = SimpleNamespace(reference="the reference's state")  # what a group is restored from
    return backend, calls


def test_a_recovery_cut_by_another_death_is_finished_on_its_new_actors(monkeypatch):
    """The rebuilt trainer group's join fails on generator 0, dead too: the generator is replaced (and
    joins with the new trainer ranks), then the trainer recovery goes on where it was cut, on the
    group already rebuilt and restored: it forms the group, and no rank is made a third time. Its
    record says what cut it; one restart each."""
    backend, calls = _backend(monkeypatch, dead={"g0"})
    backend.log = [object()]  # one update since the snapshot, made again on the rebuilt ranks
    role = backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0,
                           send_weights=False)
    assert role == "trainer"
    assert calls == [("rebuild", "trainer"), ("restore",), ("join failed on", "generator", 0),
                     ("swap", "generator", 0), ("joined",), ("joined",)]
    assert backend.cluster.trainers.actors == ("t0'", "t1'") and backend.restarts == 2
    assert [(f["role"], "cut" in f, "failed" in f) for f in backend.faults] == [("trainer", True, False),
                                                                                ("generator", False, False)]
    assert "generator 0 died during init_weight_sync" in backend.faults[0]["cut"]
    assert backend.faults[0]["replayed"] == 1 and backend.faults[1]["replayed"] == 1
    summary = backend.fault_summary()
    assert summary["restarts"] == {"trainer": 1, "generator": 1} and summary["failed_recoveries"] == {}
    assert set(summary["recovery_s_median"]) == {"trainer", "generator"}
    assert backend.fault_metrics()["faults/restarts/trainer"] == 1.0


def test_a_recovery_that_fails_for_good_is_recorded_as_failed(monkeypatch):
    """A trainer rebuild whose join fails on a generator that cannot be replaced (no restarts left):
    the trainer's record keeps the failure that cut it last, and the summary counts it as failed."""
    backend, calls = _backend(monkeypatch, dead={"g0"})
    backend.max_actor_restarts = 1
    with pytest.raises(ActorFailure, match="max_restarts"):
        backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0,
                        send_weights=False)
    assert calls == [("rebuild", "trainer"), ("restore",), ("join failed on", "generator", 0)]
    assert [(f["role"], "failed" in f) for f in backend.faults] == [("trainer", True)]
    assert "generator 0 died during init_weight_sync" in backend.faults[0]["failed"]
    assert backend.fault_summary()["failed_recoveries"] == {"trainer": 1}


def test_two_generators_dead_together_are_each_replaced_once(monkeypatch):
    """Generators 0 and 1 died together. Generator 0's replacement joins with generator 1, dead: the
    join fails, and generator 1 is replaced with generator 0's replacement as its peer, so its join
    succeeds; generator 0's recovery then forms the group again on its replacement. Two restarts.
    Before, a failed join killed the replacement, the cluster kept the dead actor, and the two were
    replaced in turn until the restarts ran out; later each cut try started again with a new worker
    (three restarts)."""
    backend, calls = _backend(monkeypatch, dead={"g0", "g1"}, generators=("g0", "g1"))
    backend.recover(ActorFailure("generator 0 died during generate", "generator", 0, died=True), since=0,
                    send_weights=False)
    assert calls == [("swap", "generator", 0), ("join failed on", "generator", 1), ("swap", "generator", 1),
                     ("joined",), ("joined",)]
    assert backend.cluster.generators.group.actors == ("g0'", "g1'") and backend.restarts == 2
    assert [f["rank"] for f in backend.faults] == [0, 1] and "cut" in backend.faults[0]


def test_a_target_finished_before_another_was_cut_is_not_made_again(monkeypatch):
    """A stuck collective names generators 0 and 1. Generator 0 is replaced and joined; generator 1's
    replacement is dead as the group forms (it is replaced whole by the nested recovery). Generator 0
    is not replaced a second time."""
    backend, calls = _backend(monkeypatch, dead={"g1'"}, generators=("g0", "g1"))
    stuck = ActorFailure("no answer from generator 0, generator 1", "generator", 0, stuck=True,
                         late=(("generator", 0), ("generator", 1)))
    backend.recover(stuck, since=0, send_weights=False)
    assert calls == [("swap", "generator", 0), ("joined",), ("swap", "generator", 1),
                     ("join failed on", "generator", 1), ("swap", "generator", 1), ("joined",)]
    assert backend.cluster.generators.group.actors == ("g0'", "g1''") and backend.restarts == 3


def test_a_replacement_dead_in_its_own_join_is_replaced_once_more_and_not_again(monkeypatch):
    """Generator 0's replacement dies as the group forms: the nested recovery replaces it whole (a
    second new worker, joined), so this recovery is done and not made again (which would kill the
    healthy second worker and spend a third restart); it still names the role it recovered."""
    backend, calls = _backend(monkeypatch, dead={"g0", "g0'"})
    role = backend.recover(ActorFailure("generator 0 died during generate", "generator", 0, died=True), since=0,
                           send_weights=False)
    assert role == "generator"
    assert calls == [("swap", "generator", 0), ("join failed on", "generator", 0), ("swap", "generator", 0),
                     ("joined",)]
    assert backend.cluster.generators.group.actors == ("g0''",) and backend.restarts == 2


def test_a_generator_dead_as_a_grown_group_forms_is_recovered_and_the_weights_sent(monkeypatch):
    """Growing from 1 to 2 generators: the new worker is dead by the time the group forms. It is
    replaced (the resized group is the cluster's already), the group formed and the weights sent
    again, and the run goes on with 2 live workers. Before, the failure ended the run."""
    from cluster.ray_wing import backend as backend_module
    from cluster.ray_wing import roles as roles_module

    backend, calls = _backend(monkeypatch, dead={"g1"})
    grown = lambda c, n: c._replace(generators=GeneratorWorkers(c.generators.group._replace(  # noqa: E731
        actors=("g0", "g1"))))
    monkeypatch.setattr(roles_module, "scale_generator_group", grown)
    monkeypatch.setattr(roles_module, "join_weight_sync", recovery_module.join_weight_sync)  # the stand-in
    monkeypatch.setattr(backend_module, "sync_weights", lambda c, version, **kw: calls.append(("sync",)))
    monkeypatch.setattr(RayBackend, "settle", lambda self, in_flight: None)
    assert backend.scale_generators(2)["generators/count"] == 2.0
    # the recovery formed the group with both workers: the step made again only sends the weights
    assert calls == [("join failed on", "generator", 1), ("swap", "generator", 1), ("joined",), ("sync",)]
    assert backend.cluster.generators.group.actors == ("g0", "g1'")


def test_a_trainer_recovery_cut_by_a_second_death_goes_on_from_its_cut_restore(monkeypatch):
    """Trainer rank 0 died in a sync (the failure names its actor). The rebuilt group's restore is
    cut by a critic rank's death: the critic group is rebuilt (and both groups restored), then the
    trainer recovery goes on from its cut restore on the rebuilt ranks, then forms the weight-sync
    group. The new trainer group is the cluster's before it joins, so a try that went by the dead
    actor's id would find it replaced and skip the join, and the next sync would reach ranks outside
    the sync group (a first version of the two-step recovery did, in a chaos run: no attribute
    'sync_device')."""
    backend, calls = _backend(monkeypatch)
    monkeypatch.setattr(recovery_module, "actor_id", lambda actor: actor)  # a stand-in is its own id

    def restore(self):
        calls.append(("restore",))
        if calls.count(("restore",)) == 1:
            raise ActorFailure("critic 0 died during restore", "critic", 0, died=True)

    monkeypatch.setattr(RayBackend, "_restore_groups", restore)
    backend.recover(ActorFailure("trainer 0 died during send_weights", "trainer", 0, died=True, actor_id="t0"),
                    since=0, send_weights=False)
    assert calls == [("rebuild", "trainer"), ("restore",), ("rebuild", "critic"), ("restore",),
                     ("restore",), ("joined",)]
    assert backend.cluster.trainers.actors == ("t0'", "t1'") and backend.restarts == 2


def test_recoveries_that_keep_failing_stop_at_the_bound_and_each_is_recorded(monkeypatch):
    """Every replacement dies as the group forms: the recoveries stop at ``max_actor_restarts``."""
    backend, calls = _backend(monkeypatch, dead={"g0"}, born_dead=True)
    with pytest.raises(ActorFailure, match="max_restarts"):
        backend.recover(ActorFailure("generator 0 died", "generator", 0, died=True), since=0, send_weights=False)
    assert backend.restarts == 5
    assert len(backend.faults) == 5  # every attempt that ran, failed or not, up to max_actor_restarts
    assert all(f["role"] == "generator" and "failed" in f for f in backend.faults)


def test_filters_failing_on_the_same_rows_with_nothing_to_replace_stop_at_a_bound():
    """A lost object whose maker was already replaced: each recovery has nothing to do and the
    filters fail again on the same rows. ``select`` raises after its bound instead of looping."""
    from cluster.loop.train import SELECT_ATTEMPTS, select

    class Backend:
        restarts, calls, recovered = 0, 0, 0

        def select(self, rows, filters):
            self.calls += 1
            raise ActorFailure("reward 0.select: object lost", "reward", 0, died=True, actor_id="gone")

        def recover(self, failure, since):
            self.recovered += 1  # the maker is not in the cluster any more: nothing replaced

    backend = Backend()
    with pytest.raises(ActorFailure, match="object lost"):
        select(backend, ["row"], [lambda rows: rows])
    assert backend.calls == SELECT_ATTEMPTS + 1 and backend.recovered == SELECT_ATTEMPTS


def test_a_replacement_and_a_rebuilt_group_start_under_the_start_bound(monkeypatch):
    """A new actor's start (a swapped worker's ``info``, a rebuilt group's ``endpoint`` and ``setup``)
    is waited for under ``cluster.start_timeout_s`` (``replace.py``; the other start sites pass the same
    bound, unchecked here). Unset, the start bound is the call bound."""
    from types import SimpleNamespace

    from cluster.ray_wing import replace as replace_module
    from cluster.ray_wing.config import ClusterConfig, start_s

    waits = []

    def gather(calls, timeout_s, waited_s=None):
        waits.append((tuple(c.method for c in calls), timeout_s))
        return [("127.0.0.1", 1)] * len(calls)

    class Remote:
        def remote(self, *args, **kwargs):
            return object()

    class Actor:
        def __getattr__(self, name):
            return Remote()

    factory = SimpleNamespace(create=lambda rank, pg, index: Actor())
    monkeypatch.setattr(replace_module, "gather", gather)
    monkeypatch.setattr(replace_module, "kill_actor", lambda actor: None)
    monkeypatch.setattr(replace_module, "call", lambda group, rank, method, *a: SimpleNamespace(method=method))
    monkeypatch.setattr(replace_module, "fan_out", lambda group, method, *a: [SimpleNamespace(method=method)] * 2)
    cluster, _ = _backend(monkeypatch)
    cluster = cluster.cluster._replace(factories={"generator": factory, "trainer": factory}, timeout_s=7.0,
                                       start_timeout_s=300.0)
    replace_module.swap_actor(cluster, "generator", 0)
    replace_module.rebuild_group(cluster, "trainer")
    assert waits == [(("info",), 300.0), (("endpoint",), 300.0), (("setup", "setup"), 300.0)]
    assert cluster._replace(start_timeout_s=None).start_s == 7.0
    assert start_s(ClusterConfig(call_timeout_s=30)) == 30 and start_s(ClusterConfig(start_timeout_s=5)) == 5


def test_a_generator_sync_cut_by_another_generator_is_sent_again(monkeypatch):
    """Generator 0's replacement joined, and the weights sent to it fail on generator 1 (dead): generator
    1 is replaced, joined and sent the weights; generator 0's recovery then sends them again, and
    replaces nothing more."""
    backend, calls = _backend(monkeypatch, generators=("g0", "g1"))

    def sync(c, version, **kw):
        calls.append(("sync",))
        if calls.count(("sync",)) == 1:
            raise ActorFailure("generator 1 died during receive_weights", "generator", 1, died=True)

    monkeypatch.setattr(recovery_module, "sync_weights", sync)
    backend.recover(ActorFailure("generator 0 died during generate", "generator", 0, died=True), since=0)
    assert calls == [("swap", "generator", 0), ("joined",), ("sync",), ("swap", "generator", 1), ("joined",),
                     ("sync",), ("sync",)]
    assert backend.cluster.generators.group.actors == ("g0'", "g1'") and backend.restarts == 2
    assert "cut" in backend.faults[0] and "cut" not in backend.faults[1]


def test_a_cut_that_no_recovery_can_mend_is_tried_again_and_ends_bounded(monkeypatch):
    """The rebuilt group's restore fails on an actor no longer in the cluster (replaced already): the
    nested recovery has nothing to do, and the restore is made again on the same ranks, at no restart.
    Once: the recovery then finishes. Every time: it ends after ``max_actor_restarts`` cuts, final,
    naming what cut it."""
    backend, calls = _backend(monkeypatch)
    monkeypatch.setattr(recovery_module, "actor_id", lambda actor: actor)
    gone = ActorFailure("trainer 0 died during restore", "trainer", 0, died=True, actor_id="an old rank")

    def restore_once(self):
        calls.append(("restore",))
        if calls.count(("restore",)) == 1:
            raise gone

    monkeypatch.setattr(RayBackend, "_restore_groups", restore_once)
    backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0)
    assert calls == [("rebuild", "trainer"), ("restore",), ("restore",), ("joined",)] and backend.restarts == 1

    backend, calls = _backend(monkeypatch)

    def restore_never(self):
        calls.append(("restore",))
        raise gone

    monkeypatch.setattr(RayBackend, "_restore_groups", restore_never)
    backend.max_actor_restarts = 3
    with pytest.raises(ActorFailure, match="its recovery was cut 4 times, the last time by: trainer 0 died") as raised:
        backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0)
    assert raised.value.final and calls.count(("restore",)) == 4 and backend.restarts == 1
    assert "failed" in backend.faults[0]


def test_a_critic_rebuild_cut_by_a_trainer_death_goes_on_after_the_trainers(monkeypatch):
    """A critic group rebuilt; a trainer rank dies during the restore: the trainer group is rebuilt,
    restored and joined, then the critic recovery restores again on its rebuilt ranks (the trainers'
    restore restored both groups; once more is the same state)."""
    backend, calls = _backend(monkeypatch)

    def restore(self):
        calls.append(("restore",))
        if calls.count(("restore",)) == 1:
            raise ActorFailure("trainer 0 died during restore", "trainer", 0, died=True)

    monkeypatch.setattr(RayBackend, "_restore_groups", restore)
    backend.recover(ActorFailure("critic 1 died during value_step_planned", "critic", 1, died=True), since=0)
    assert calls == [("rebuild", "critic"), ("restore",), ("rebuild", "trainer"), ("restore",), ("joined",),
                     ("restore",)]
    assert backend.restarts == 2 and [f["role"] for f in backend.faults] == ["critic", "trainer"]


def test_a_tracking_reference_cut_in_its_join_is_restored_after_the_generator(monkeypatch):
    """A tracking reference worker's replacement joins with a dead generator: the generator is
    replaced (its join takes the new reference in), then the reference's recovery forms the group and
    restores its state from the snapshot, on its one replacement."""
    backend, calls = _backend(monkeypatch, dead={"g0"}, reference=True)
    backend.recover(ActorFailure("reference 0 died during logprobs", "reference", 0, died=True), since=0,
                    send_weights=False)
    assert calls == [("swap", "reference", 0), ("join failed on", "generator", 0), ("swap", "generator", 0),
                     ("joined",), ("joined",), ("r0'", "restore")]
    assert backend.cluster.reference.group.actors == ("r0'",) and backend.restarts == 2


def test_the_roles_a_recovery_replaced_nested_ones_too_reach_the_retry(monkeypatch):
    """``recovering`` hands its ``after`` every role replaced, a nested recovery's too. (So
    ``_move_again`` sees a tracking reference replaced inside a trainer recovery, which the outer
    recovery's role alone, "trainer", did not show; that it then moves it is not checked here.)"""
    backend, calls = _backend(monkeypatch, dead={"r0"}, reference=True)
    seen, tries = [], []

    def op():
        tries.append(1)
        if len(tries) == 1:
            raise ActorFailure("trainer 0 died during snapshot", "trainer", 0, died=True)
        return "done"

    assert backend.recovering(op, seen.append) == "done"
    assert seen == [{"trainer", "reference"}]


def test_a_new_clusters_actors_start_under_the_start_bound(monkeypatch):
    """At a cluster's start, trainer rank 0's ``endpoint`` and every other actor's ``info`` (their
    constructors: imports, model load) are waited for under ``cluster.start_timeout_s``."""
    from types import SimpleNamespace

    from cluster.ray_wing import startup as startup_module
    from cluster.ray_wing.config import ClusterConfig

    waits = []

    def gather(calls, timeout_s, waited_s=None):
        waits.append((tuple(c.method for c in calls), timeout_s))
        return [("127.0.0.1", 1)] * len(calls)

    monkeypatch.setattr(startup_module, "gather", gather)
    monkeypatch.setattr(startup_module, "call", lambda group, rank, method, *a: SimpleNamespace(method=method))
    monkeypatch.setattr(startup_module, "fan_out",
                        lambda group, method, *a: [SimpleNamespace(method=method)] * len(group.actors))
    made = startup_module.Roles(WorkerGroup("trainer", ("t0", "t1")),
                                GeneratorWorkers(WorkerGroup("generator", ("g0",))), WorkerGroup("reward", ("w0",)),
                                None, {})
    setups, _ = startup_module.start_roles(made, ClusterConfig(call_timeout_s=7.0, start_timeout_s=300.0))
    assert waits == [(("endpoint",), 300.0), (("info", "info"), 300.0)] and len(setups) == 2


def test_a_cut_recoverys_seconds_count_both_of_its_tries_and_not_the_nested_one(monkeypatch):
    """Seconds by hand, on a clock the stand-in steps move: the trainer rebuild takes 10, its restore
    1, its join 5 before it fails on generator 0; the generator's swap 3 and join 5; the trainer's
    join after it 5. The trainer's record: 10 + 1 + 5 + 5 = 21 (the nested 8 not counted), the
    generator's 8, ``faults/seconds_lost`` 29, the median recovery 21 and 8."""
    backend, calls = _backend(monkeypatch, dead={"g0"})
    now = [100.0]
    monkeypatch.setattr(recovery_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    costs = {"rebuild": 10.0, "restore": 1.0, "swap": 3.0, "joined": 5.0, "join failed on": 5.0}

    def advance(name, step):
        def run(*args):
            try:
                return step(*args)
            finally:
                now[0] += costs[calls[-1][0]]
        monkeypatch.setattr(recovery_module if name != "_restore_groups" else RayBackend, name, run)

    for name in ("rebuild_group", "swap_actor", "join_weight_sync"):
        advance(name, getattr(recovery_module, name))
    advance("_restore_groups", RayBackend._restore_groups)
    backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0,
                    send_weights=False)
    assert calls == [("rebuild", "trainer"), ("restore",), ("join failed on", "generator", 0),
                     ("swap", "generator", 0), ("joined",), ("joined",)]
    assert [(f["role"], f["seconds"]) for f in backend.faults] == [("trainer", 21.0), ("generator", 8.0)]
    assert backend.fault_metrics()["faults/seconds_lost"] == 29.0
    assert backend.fault_summary()["recovery_s_median"] == {"trainer": 21.0, "generator": 8.0}
