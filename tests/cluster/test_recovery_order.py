"""The order a recovery replaces actors in, and what it records, without Ray (the cluster's
replace and rebuild steps stand in): single actors before DeepSpeed groups, and a failed attempt
in ``faults`` and the summary as well as the one that succeeds."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.loop.protocol import ActorFailure
from cluster.ray_wing import recovery as recovery_module
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import WorkerGroup
from cluster.ray_wing.handles import GeneratorWorkers
from cluster.ray_wing.recovery import _single_actors_first
from cluster.ray_wing.roles import RLCluster

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


def _backend(monkeypatch, rebuild_failures: int) -> tuple:
    cluster = RLCluster(generators=GeneratorWorkers(WorkerGroup("generator", ("g0",))),
                        trainers=WorkerGroup("trainer", ("t0", "t1")), rewards=None, reference=None,
                        sync_address=None, weight_meta=(), pad_token_id=0, bucket_bytes=0, timeout_s=60,
                        ray_address="")
    calls = []

    def rebuild(c, role):
        calls.append(("rebuild", role))
        if sum(x == ("rebuild", role) for x in calls) <= rebuild_failures:  # the rebuilt group's join waits on it
            raise ActorFailure("no answer within 60s from: generator 0.init_weight_sync", "generator", 0, stuck=True)
        return c

    def replace(c, role, rank):
        calls.append(("replace", role, rank))
        return c

    monkeypatch.setattr(recovery_module, "rebuild_group", rebuild)
    monkeypatch.setattr(recovery_module, "replace_actor", replace)
    monkeypatch.setattr(RayBackend, "_restore_groups", lambda self: calls.append(("restore",)))
    backend = RayBackend(cluster, max_actor_restarts=5)
    backend.snapshot = object()  # a snapshot to restore a trainer group from
    return backend, calls


def test_a_failed_recovery_is_recorded_and_the_next_one_succeeds(monkeypatch):
    backend, calls = _backend(monkeypatch, rebuild_failures=1)
    role = backend.recover(ActorFailure("trainer 1 died during train_planned", "trainer", 1, died=True), since=0,
                           send_weights=False)
    assert role == "trainer"
    # the rebuild failed on the generator; the generator was replaced; the rebuild was made again
    assert calls == [("rebuild", "trainer"), ("replace", "generator", 0), ("rebuild", "trainer"), ("restore",)]
    assert [(f["role"], "failed" in f) for f in backend.faults] == [("trainer", True), ("generator", False),
                                                                     ("trainer", False)]
    assert "generator 0.init_weight_sync" in backend.faults[0]["failed"]
    summary = backend.fault_summary()
    assert summary["restarts"] == {"trainer": 2, "generator": 1} and summary["failed_recoveries"] == {"trainer": 1}
    assert set(summary["recovery_s_median"]) == {"trainer", "generator"}  # the failed attempt's time is not a recovery
    assert backend.fault_metrics()["faults/restarts/trainer"] == 2.0


def test_recoveries_that_keep_failing_stop_at_the_bound_and_each_is_recorded(monkeypatch):
    backend, calls = _backend(monkeypatch, rebuild_failures=99)
    with pytest.raises(ActorFailure, match="max_restarts"):
        backend.recover(ActorFailure("trainer 1 died", "trainer", 1, died=True), since=0, send_weights=False)
    assert backend.restarts == 5
    failed = [f for f in backend.faults if "failed" in f]
    assert failed and all(f["role"] == "trainer" for f in failed)
    assert len(backend.faults) == 5  # every attempt that ran, failed or not, up to max_actor_restarts


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
