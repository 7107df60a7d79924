"""Invariant 10: any single worker's death is survived, trainer and critic ranks included, and the
run ends with the weights of an undisturbed run.

Each test runs the same few RL steps twice on fresh clusters: once undisturbed, once with one
actor killed (SIGKILL) or stopped (SIGSTOP) from outside, by PID, while it runs a chosen call
(``tests.chaos``). The disturbed run must recover (``faults/*`` name the role) and end with the
policy's, the critic's and the reference's weights of the undisturbed run within 1e-5.

The tests that start actors are marked ``apart``: much of their time is waiting (a kill waited for, a stopped
process found by the call timeout, a replacement's start), so under ``make test`` they run beside the Ray
tests, on their tier's own Ray (``tests/suite.py``).
"""
import signal
import time

import numpy as np
import pytest

from cluster.loop.protocol import ActorFailure
from cluster.loop.train import Hooks, RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import call, fan_out, gather
from cluster.ray_wing.roles import add_critics, build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import sync_weights
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo, ppo
from primitives.maths.kl import create_ema_updater
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.chaos import our_scratch, signal_when
from tests.rewards import spread_reward


@pytest.fixture(autouse=True)
def no_scratch_left(request):
    """A rank killed mid-snapshot (or by its group's rebuild) leaves its scratch directory behind:
    the next snapshot on the machine, or the cluster's shutdown, removes it. None may outlive a test
    that started actors. A test here without them runs in the tier beside, where another tier's cluster
    may be between a kill and its sweep: it is not asked."""
    yield
    if "ray_local" in request.fixturenames:
        assert our_scratch() == []


ITEMS = make_arithmetic_task(ArithmeticTaskSpec(num_train=24, num_heldout=1, seed=3))[0]
STEPS = 6


def _build(path, trainers=2, zero=2, tracking=True, critic=False, timeout=120.0, on_trainers=False):
    cfg = ClusterConfig(generators=1, trainers=trainers, zero_stage=zero, critics=2, call_timeout_s=timeout,
                        start_timeout_s=120.0, reference_on_trainers=on_trainers, generate_on_trainers=on_trainers)
    cluster = build_rl_cluster(path, cfg, TrainerConfig(zero_stage=zero, lr=1e-3, micro_batch_size=4), spread_reward,
                               with_reference=True, ref_update_fn=create_ema_updater(0.5) if tracking else None,
                               reserve_critics=critic)
    if critic:
        cluster = add_critics(cluster, cluster_model(path), cfg, TrainerConfig(zero_stage=zero, lr=1e-3,
                                                                                 micro_batch_size=4))
    sync_weights(cluster, 0, move_reference=False)
    return cluster


def cluster_model(path):
    from primitives.types import ModelConfig

    return ModelConfig(path)


def _run(path, kills=(), snapshot_every=1, prompts=4, n=2, algo=None, staleness=0, **build):
    """Weights (policy, critic, reference) and metrics after ``STEPS`` steps; ``kills`` are
    ``(step, class, method, signal)``: once step ``step`` is logged, the signal goes to the first
    actor of ``class`` seen running ``method``."""
    cluster = _build(path, **build)
    backend = RayBackend(cluster, max_actor_restarts=4, snapshot_every=snapshot_every)

    def logger(m):
        for step, cls, method, sig in kills:
            if m["step"] == step:  # only this cluster's actors (not kept idle ones), their titles alone read
                signal_when(cls, method, sig, among=_pids(backend.cluster, cls))

    try:
        state = train(backend, make_prompt_source(ITEMS, seed=4), constant_schedule(algo or grpo(kl_coef=0.05)),
                      RLRun(GenerationConfig(max_new_tokens=4, n=n), num_steps=STEPS, prompts_per_step=prompts,
                            lr_schedule=lambda s: 1e-3, progress=False, max_staleness=staleness),
                      hooks=Hooks(logger=logger))
        c = backend.cluster
        weights = {"policy": gather(fan_out(c.trainers, "full_state"), c.timeout_s)[0]}
        if c.critics is not None:
            weights["critic"] = gather(fan_out(c.critics, "full_state"), c.timeout_s)[0]
        if c.reference.where == "workers":
            weights["reference"] = gather([call(c.reference.group, 0, "snapshot")], c.timeout_s)[0][1]["weights"]
        else:  # rank 0's part holds the copy every rank keeps
            weights["reference"] = gather(fan_out(c.trainers, "snapshot"), c.timeout_s)[0][1]["reference"]["weights"]
        return weights, state.metrics_history, backend
    finally:
        shutdown_cluster(backend.cluster)


def _pids(cluster, cls: str) -> set:
    """The processes of ``cluster``'s actors of class ``cls``."""
    groups = {"GeneratorWorker": lambda: cluster.generator_workers.group, "TrainerWorker": lambda: cluster.trainers,
              "CriticWorker": lambda: cluster.critic_group, "RefLogprobWorker": lambda: cluster.reference_workers.group}
    return {info["pid"] for info in gather(fan_out(groups[cls](), "info"), cluster.timeout_s)}


def _max_diff(a: dict, b: dict) -> float:
    out = 0.0
    for role in a:
        for name in a[role]:
            x, y = np.asarray(a[role][name], dtype=np.float64), np.asarray(b[role][name], dtype=np.float64)
            out = max(out, float(np.abs(x - y).max()))
    return out


_UNDISTURBED: dict = {}


def _undisturbed(path, key, **kwargs):
    if key not in _UNDISTURBED:
        _UNDISTURBED[key] = _run(path, **kwargs)
    return _UNDISTURBED[key]


KILLED = {"TrainerWorker": "trainer", "RefLogprobWorker": "reference", "GeneratorWorker": "generator",
          "CriticWorker": "critic"}


@pytest.mark.apart
@pytest.mark.parametrize("kills", [
    ((1, "TrainerWorker", "train_planned"), (3, "RefLogprobWorker", "receive_weights")),
    ((1, "TrainerWorker", "send_weights"), (2, "RefLogprobWorker", "logprobs_counted"), (4, "GeneratorWorker", ""))],
    ids=["trainer-in-train-step+reference-in-its-move", "trainer-in-sync+reference-scoring+generator-between-steps"])
def test_killed_actors_are_recovered_with_undisturbed_weights(ray_local, tiny_model_path, kills):
    """A trainer rank (in its update, or sending weights) and the EMA reference (while it moves, or
    scores) are killed mid-call, and a generator between steps, one after another; the run
    recovers each and ends where the undisturbed run does."""
    base, base_history, _ = _undisturbed(tiny_model_path, "grpo")
    weights, history, backend = _run(tiny_model_path, kills=[(*k, signal.SIGKILL) for k in kills])
    roles = [KILLED[cls] for _, cls, _ in kills]
    assert [f["role"] for f in backend.faults] == roles
    for role in roles:
        assert history[-1][f"faults/restarts/{role}"] == 1.0
    assert history[-1]["faults/seconds_lost"] > 0
    assert _max_diff(base, weights) <= 1e-5
    for before, after in zip(base_history, history, strict=True):  # every step trained the same batch
        assert after["batch/rows"] == before["batch/rows"]
        assert after["reward/mean"] == pytest.approx(before["reward/mean"], abs=1e-6)
        assert after["loss/policy"] == pytest.approx(before["loss/policy"], abs=1e-5)


@pytest.mark.apart
@pytest.mark.parametrize("kills", [((1, "CriticWorker", "value_step_planned"), (3, "TrainerWorker", "train_planned")),
                                   ((1, "CriticWorker", "values_planned"),)],
                         ids=["critic-in-its-update+trainer-beside-the-critic", "critic-computing-values"])
def test_ppo_critic_or_trainer_killed_gives_undisturbed_policy_and_critic(ray_local, tiny_model_path, kills):
    """PPO with a 2-rank critic group: a critic rank dies in its update or computing values, or a
    trainer rank while the critic updates beside it; both groups go back to the snapshot and
    the step is made once."""
    algo = ppo(kl_coef=0.05)
    base, _, _ = _undisturbed(tiny_model_path, "ppo", critic=True, tracking=False, algo=algo)
    weights, history, backend = _run(tiny_model_path, kills=[(*k, signal.SIGKILL) for k in kills], critic=True,
                                     tracking=False, algo=algo)
    assert [f["role"] for f in backend.faults] == [KILLED[cls] for _, cls, _ in kills]
    assert _max_diff(base, weights) <= 1e-5
    assert history[-1]["critic/grad_norm"] > 0


@pytest.mark.apart
def test_zero3_three_ranks_uneven_shards_snapshot_every_three_steps(ray_local, tiny_model_path):
    """ZeRO-3 over 3 trainer ranks, 8 rows a step (3, 3, 2), a snapshot every 3 steps: a rank
    killed at step 2 or later is restored from the older snapshot and the updates since are
    made again from the log. The generator, synced by rank 0 gathering one bucket at a time from
    the 3 ranks' shards, sampled with the trainers' weights at every step (logprob parity)."""
    kwargs = dict(trainers=3, zero=3, tracking=False, snapshot_every=3)
    base, undisturbed, _ = _undisturbed(tiny_model_path, "zero3", **kwargs)
    assert max(m["mismatch/max_abs_logp_diff"] for m in undisturbed) < 1e-4
    weights, history, backend = _run(tiny_model_path, kills=[(1, "TrainerWorker", "train_planned", signal.SIGKILL)],
                                     **kwargs)
    assert [(f["role"], f["replayed"]) for f in backend.faults] == [("trainer", 2)]  # steps 0 and 1 made again
    assert _max_diff(base, weights) <= 1e-5
    assert sum("faults/snapshot_s" in m for m in history) == STEPS // 3  # after steps 3 and 6


@pytest.mark.apart
def test_trainer_rebuilt_with_its_hosted_generator_and_moving_reference(ray_local, tiny_model_path):
    """The default job's shape: generation and an EMA reference on the trainer ranks. A rank dies
    two steps after a snapshot (every 3): the rebuilt ranks get the snapshot's reference copy,
    replay two updates and the reference's two moves, and generate at the right version."""
    kwargs = dict(on_trainers=True, tracking=True, snapshot_every=3)
    base, _, _ = _undisturbed(tiny_model_path, "on_trainers", **kwargs)
    weights, history, backend = _run(tiny_model_path, kills=[(4, "TrainerWorker", "train_planned", signal.SIGKILL)],
                                     **kwargs)
    assert [(f["role"], f["replayed"]) for f in backend.faults] == [("trainer", 2)]
    assert _max_diff(base, weights) <= 1e-5
    assert history[-1]["staleness/max"] == 0  # the rebuilt ranks' generators carry the current version


@pytest.mark.apart
def test_trainer_killed_in_asynchronous_run(ray_local, tiny_model_path):
    """Staleness 1: the next step's rollouts are generated while a trainer rank dies in its
    update; the rebuilt group rejoins the broadcast and the run ends as undisturbed."""
    base, _, _ = _undisturbed(tiny_model_path, "async", staleness=1, tracking=False)
    weights, history, backend = _run(tiny_model_path, kills=[(1, "TrainerWorker", "train_planned", signal.SIGKILL)],
                                     staleness=1, tracking=False)
    assert [f["role"] for f in backend.faults] == ["trainer"]
    assert _max_diff(base, weights) <= 1e-5
    assert max(m["staleness/max"] for m in history) == 1


@pytest.mark.apart
def test_stopped_generator_is_killed_replaced_and_named(ray_local, tiny_model_path, capsys):
    """A generator that stops answering (SIGSTOP) mid-generation is caught by the call timeout,
    killed, replaced and named in the log; the run's weights are the undisturbed run's. The call
    bound is 10 s (every tiny-model call takes well under a second), the start bound 120 s, so the
    replacement's start (a new process, its imports and model load) has room on a slow machine."""
    base, _, _ = _undisturbed(tiny_model_path, "grpo")
    t0 = time.time()
    weights, _, backend = _run(tiny_model_path, kills=[(1, "GeneratorWorker", "generate", signal.SIGSTOP)],
                                  timeout=10.0)
    assert [(f["role"], f["stuck"]) for f in backend.faults] == [("generator", True)]
    out = capsys.readouterr()
    assert "no answer within 10s from: generator 0.generate" in out.out + out.err
    assert "generator 0 stopped answering: killing it" in out.out + out.err
    assert _max_diff(base, weights) <= 1e-5
    assert time.time() - t0 < 180


@pytest.mark.apart
def test_generator_stopped_in_a_weight_sync_is_replaced_before_the_trainers(ray_local, tiny_model_path):
    """A generator stopped (SIGSTOP) while it receives the weights is replaced first, before any
    trainer rank that waited for it in the broadcast (with a larger model, trainer rank 0 blocks
    there and the timeout names both; the tiny model's sync fits in the sockets' buffers, so the
    trainers may have finished), no attempt fails, and the run ends with the undisturbed weights.
    Before, the trainers came first and their rebuild waited on the stopped generator until the
    restarts were spent (``test_recovery_order.py`` holds the order for every mix of targets)."""
    base, _, _ = _undisturbed(tiny_model_path, "grpo")
    weights, _, backend = _run(tiny_model_path, kills=[(1, "GeneratorWorker", "receive_weights", signal.SIGSTOP)],
                               timeout=10.0)
    roles = [(f["role"], f["stuck"]) for f in backend.faults]
    assert roles[0] == ("generator", True) and set(roles) <= {("generator", True), ("trainer", True),
                                                             ("reference", True)}, backend.faults
    assert not any("failed" in f for f in backend.faults), backend.faults
    assert _max_diff(base, weights) <= 1e-5


@pytest.mark.apart
def test_recoveries_are_bounded_and_a_raising_function_is_not_retried(ray_local, tiny_model_path):
    """``max_actor_restarts`` bounds the recoveries (the error says so); a user function that
    raises is a bug, reported at once, never retried."""
    cluster = _build(tiny_model_path, tracking=False)
    backend = RayBackend(cluster, max_actor_restarts=0)
    try:
        signal_when("TrainerWorker", "train_planned")
        with pytest.raises(ActorFailure, match=r"trainer \d died .*after 0 recoveries, cluster.max_restarts"):
            train(backend, make_prompt_source(ITEMS, seed=4), constant_schedule(grpo()),
                  RLRun(GenerationConfig(max_new_tokens=4, n=2), num_steps=3, prompts_per_step=4,
                        lr_schedule=lambda s: 1e-3, progress=False))
        failure = ActorFailure("reward 0 failed in score: ZeroDivisionError", "reward", 0)
        assert not failure.replaceable
        with pytest.raises(ActorFailure, match="ZeroDivisionError"):
            backend.recover(failure, since=0)
    finally:
        shutdown_cluster(backend.cluster)


def test_snapshot_interval_by_count_or_by_cost():
    """``snapshot_every`` N: after every N updates; None: once the time since the last snapshot
    is its cost over ``snapshot_overhead`` (a 0.1 s snapshot at 5 %: every 2 s); 0: never."""
    from types import SimpleNamespace

    from cluster.ray_wing.snapshots import Snapshot

    cluster = SimpleNamespace(reference=None)
    by_count = RayBackend(cluster, snapshot_every=3)
    by_count.log = [object()] * 2
    assert not by_count.snapshot_due()
    by_count.log = [object()] * 3
    assert by_count.snapshot_due()
    assert not RayBackend(cluster, snapshot_every=0).snapshot_due()

    by_cost = RayBackend(cluster, snapshot_every=None, snapshot_overhead=0.05)
    by_cost.snapshot = Snapshot((), (), None, 1, seconds=0.1)
    by_cost.log = [object()]
    by_cost.snapshot_at = time.perf_counter() - 1.9
    assert not by_cost.snapshot_due()
    by_cost.snapshot_at = time.perf_counter() - 2.1
    assert by_cost.snapshot_due()
    by_cost.log = []  # nothing trained since: nothing to snapshot
    assert not by_cost.snapshot_due()
