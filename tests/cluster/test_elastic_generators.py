"""Generator workers grown and shrunk while a run goes on (``RayBackend.scale_generators``,
``RLRun.generator_policy``): 1 -> 3 -> 2 workers in one run. Every prompt uid is trained
exactly once (also with generation in flight across a change), new workers hold the trainers'
weights, and the steps after each change equal a run started at that size from the same
state (a checkpoint of the scaled run at the change)."""
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.loop.train import Hooks, RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import call, fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.maths.scaling import idle_scaling_policy, step_scaling_policy
from primitives.types import GenerationConfig, TrainState, planned_rollouts
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread5_reward

GEN = GenerationConfig(max_new_tokens=4, n=2, temperature=1.0)
PROMPTS, LR, STEPS = 6, 1e-3, 6  # 6 prompts split evenly over 1, 2 or 3 workers
COUNTS = [(0, 1), (2, 3), (4, 2)]
TIMES = ("time/", "idle/", "sync/", "generators/", "recovery/", "faults/")  # what a resumed or resized run may change


class Recording(RayBackend):
    """Records the uids each step trains on."""

    def __init__(self, cluster, ray):
        super().__init__(cluster)
        self.ray, self.trained_uids = ray, []

    def train_step(self, plan, parts, *args, **kwargs):
        pulled = [tuple(None if x is None else self.ray.get(x) for x in part) for part in parts]
        self.trained_uids.append([r.uid for r in planned_rollouts(plan, pulled)])
        return super().train_step(plan, parts, *args, **kwargs)


@pytest.fixture(scope="module")
def items():
    return make_arithmetic_task(ArithmeticTaskSpec(num_train=24, num_heldout=1, seed=4))[0]


def _run(ray, model, generators: int, items, policy=None, staleness: int = 0, resume=None, save_to=None,
         steps: int = STEPS) -> tuple:
    cfg = ClusterConfig(generators=generators, trainers=2, reward_workers=1, zero_stage=2, call_timeout_s=300)
    backend = Recording(build_rl_cluster(model, cfg, TrainerConfig(zero_stage=2, lr=LR), spread5_reward,
                                         with_reference=False, seed=0), ray)
    try:
        state = backend.load(resume) if resume else TrainState(rng_seed=0)
        save = (lambda b, s: b.save(os.path.join(save_to, f"step_{s.iteration}"), s)) if save_to else None
        state = train(backend, make_prompt_source(items, seed=2), constant_schedule(grpo(kl_coef=0.0)),
                      RLRun(GEN, num_steps=steps, prompts_per_step=PROMPTS, lr_schedule=lambda s: LR,
                            max_staleness=staleness, progress=False, generator_policy=policy),
                      state=state, hooks=Hooks(checkpoint_fn=save, checkpoint_every=2 if save else 0))
        c = backend.cluster
        trainer = gather(fan_out(c.trainers, "weight_checksums"), c.timeout_s)[0]
        held = gather(fan_out(c.generators.group, "weight_checksums"), c.timeout_s)
        live = len(c.generators.group.actors)
    finally:
        shutdown_cluster(backend.cluster)
    return state, backend.trained_uids, trainer, held, live


def _same(a: dict, b: dict) -> None:
    keys = [k for k in a if not k.startswith(TIMES) and isinstance(a[k], float)]
    assert keys and keys == [k for k in b if not k.startswith(TIMES) and isinstance(b[k], float)]
    for k in keys:
        assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), k


def test_one_three_two_generators_in_one_run_equal_runs_started_at_each_size(ray_local, tiny_model_path, items,
                                                                             tmp_path):
    ckpt = str(tmp_path / "ckpt")
    state, uids, trainer, held, live = _run(ray_local, tiny_model_path, 1, items, step_scaling_policy(COUNTS),
                                            save_to=ckpt)
    history = state.metrics_history
    assert [m["generators/count"] for m in history] == [1.0, 1.0, 3.0, 3.0, 2.0, 2.0]
    assert [("time/scale" in m) for m in history] == [False, False, True, False, True, False]
    assert live == 2 and all(sums == trainer for sums in held)  # the workers left hold the trained weights
    flat = [u for step in uids for u in step]
    assert len(flat) == len(set(flat)) == STEPS * PROMPTS * GEN.n  # every step full, nothing twice
    # 36 prompts over 24 items: epoch 0 whole, then epoch 1's first 12 of its order, each once
    groups = {u.rsplit("/", 1)[0] for u in flat}
    assert len(groups) == STEPS * PROMPTS and sum(g.startswith("e0/") for g in groups) == 24
    # the steps after each change, against a run started at that size from the checkpoint at the change
    for start, size in ((2, 3), (4, 2)):
        resumed, resumed_uids, *_ = _run(ray_local, tiny_model_path, size, items, resume=os.path.join(
            ckpt, f"step_{start}"), steps=start + 2)
        assert resumed_uids == uids[start: start + 2]  # the same rollouts ...
        for a, b in zip(history[start: start + 2], resumed.metrics_history[start:]):
            _same(a, b)  # ... and the same update


def test_a_shrink_with_generation_in_flight_loses_and_repeats_nothing(ray_local, tiny_model_path, items):
    """Asynchronous RL (max_staleness=1): when the count changes, the next step's rollouts are
    in flight on the old workers; they finish where they run before a worker leaves, so every
    prompt is still trained exactly once and no step regenerates (staleness stays 1)."""
    state, uids, trainer, held, live = _run(ray_local, tiny_model_path, 1, items, step_scaling_policy(COUNTS),
                                            staleness=1)
    flat = [u for step in uids for u in step]
    assert len(flat) == len(set(flat)) == STEPS * PROMPTS * GEN.n
    assert [m["generators/count"] for m in state.metrics_history] == [1.0, 1.0, 3.0, 3.0, 2.0, 2.0]
    assert [m["staleness/max"] for m in state.metrics_history][1:] == [1.0] * (STEPS - 1)
    assert all(m["recovery/actor_restarts"] == 0 for m in state.metrics_history)
    assert live == 2 and all(sums == trainer for sums in held)


def test_the_idle_policy_grows_when_the_trainers_wait_and_shrinks_when_the_generators_wait():
    policy = idle_scaling_policy(1, 3, every=2, threshold=0.3)
    waiting_trainers = [{"step": s, "idle/trainers": 0.6, "idle/generators": 0.1} for s in range(2)]
    waiting_generators = [{"step": s, "idle/trainers": 0.1, "idle/generators": 0.5} for s in range(4)]
    # the trainers would wait 0.18 * 2 / 1 = 0.36 > 0.3 with one worker less: keep 2
    close = [{"step": s, "idle/trainers": 0.18, "idle/generators": 0.5} for s in range(2)]
    assert policy(close, 2) == 2 and policy(close, 3) == 2  # 0.18 * 3 / 2 = 0.27: shrink to 2
    assert policy([{**m, "time/scale": 4.0} for m in waiting_trainers], 1) == 1  # a scaling step is left out
    balanced = [{"step": s, "idle/trainers": 0.2, "idle/generators": 0.25} for s in range(2)]
    assert policy(waiting_trainers, 1) == 2 and policy(waiting_trainers, 3) == 3  # capped at the maximum
    assert policy(waiting_generators, 2) == 1 and policy(waiting_generators, 1) == 1  # floored at the minimum
    assert policy(balanced, 2) == 2
    assert policy(waiting_trainers[:1], 1) == 1  # decides every 2 steps only
    # synchronous RL: both wait in turn; generation the longer phase -> grow
    both = [{"step": s, "idle/trainers": 0.55, "idle/generators": 0.4} for s in range(2)]
    assert policy(both, 1) == 2
    with pytest.raises(ValueError, match="need 1 <= minimum <= maximum"):
        idle_scaling_policy(3, 2)
    steps = step_scaling_policy(COUNTS)
    assert [steps([{"step": s - 1}] if s else [], 9) for s in range(6)] == [1, 1, 3, 3, 2, 2]


def test_a_resumed_run_goes_on_at_the_size_it_logged():
    """An idle policy (1-3 workers, deciding every 2 steps) whose generators wait shrinks 3 -> 2 -> 1
    by step 4. Resumed from step 5's checkpoint the cluster starts at the job's 3: the policy is
    given the logged 1, so the run goes back to 1 worker (it stayed at 3, then shrank again: 3, 2, 2
    where the run had 1, 1, 1). Without a history the cluster's own count is the policy's."""
    from collections import deque

    from cluster.loop.train import scale_for_step

    class Workers:
        def __init__(self, count):
            self.generator_count = count

        def scale_generators(self, n, in_flight):
            self.generator_count = n
            return {"generators/count": float(n), "time/scale": 0.1}

    policy = idle_scaling_policy(1, 3, every=2, threshold=0.3)
    waiting = {"idle/generators": 0.8, "idle/trainers": 0.05}

    def run(backend, history, steps):
        for step in steps:
            history.append({"step": step, **waiting, **scale_for_step(backend, policy, history, deque())})
        return history

    straight = run(Workers(3), [], range(8))
    counts = [m["generators/count"] for m in straight]
    assert counts == [3, 3, 2, 2, 1, 1, 1, 1]
    resumed = Workers(3)  # started at cluster.generators, with the checkpoint's history of steps 0-4
    assert [m["generators/count"] for m in run(resumed, [dict(m) for m in straight[:5]], range(5, 8))] == counts
    assert resumed.generator_count == 1
    assert scale_for_step(Workers(2), policy, [], deque()) == {"generators/count": 2.0}


@settings(max_examples=200, deadline=None)
@given(generate=st.floats(0.05, 20.0), train_s=st.floats(0.05, 20.0), threshold=st.floats(0.05, 0.9),
       start=st.integers(1, 8))
def test_the_idle_policy_settles_without_oscillating(generate, train_s, threshold, start):
    """Synchronous RL whose generation takes ``generate / n`` seconds on n workers and whose
    training takes ``train_s``: each role idles while the other works. From any start the
    count moves in one direction only, then stays."""
    policy = idle_scaling_policy(1, 8, every=1, threshold=threshold)
    counts, history = [start], []
    for step in range(30):
        g = generate / counts[-1]
        history.append({"step": step, "idle/trainers": g / (g + train_s), "idle/generators": train_s / (g + train_s)})
        counts.append(policy(history, counts[-1]))
    moves = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), counts
    assert counts[-1] == counts[-2] == counts[-3], counts


def test_scaling_settings_are_checked_before_ray():
    from cluster.jobs.checks import rl_errors
    from cluster.jobs.config import DataConfig, RLJob
    from cluster.ray_wing.config import GeneratorScaling

    def errors(**scaling):
        job = RLJob(data=DataConfig(task="arithmetic"))
        return rl_errors(job._replace(cluster=job.cluster._replace(scaling=GeneratorScaling(**scaling))))

    assert errors(policy="idle", minimum=1, maximum=4) == []
    assert "need 1 <= minimum (3) <= cluster.generators (2) <= maximum (4)" in " ".join(
        errors(policy="idle", minimum=3, maximum=4))
    assert "cluster.scaling.policy 'elastic' is unknown" in " ".join(errors(policy="elastic"))
    assert "cluster.scaling.at_steps must map steps to counts >= 1" in " ".join(errors(policy="steps",
                                                                                      at_steps={"5": 0}))
    job = RLJob(data=DataConfig(task="arithmetic"))
    hosted = job._replace(cluster=job.cluster._replace(generate_on_trainers=True,
                                                       scaling=GeneratorScaling(policy="idle", maximum=4)))
    assert any("cluster.scaling" in e and "would be ignored" in e for e in rl_errors(hosted))


def _same_weights(backend) -> bool:
    """Every generator worker holds the trainers' weights."""
    c = backend.cluster
    trainer = gather(fan_out(c.trainers, "weight_checksums"), c.timeout_s)[0]
    return all(s == trainer for s in gather(fan_out(c.generators.group, "weight_checksums"), c.timeout_s))


def test_a_generator_that_died_before_a_shrink_serves_the_trained_weights(ray_local, tiny_model_path, items):
    """After a step (the trainers' weights are version 1), generator 0 dies; the shrink 3 -> 2 finds it
    dead and replaces it (``settle``), and the worker kept must then hold version 1, not the base
    model's weights: before the fix a shrink never synced, so the replacement served version 0 and
    every later step regenerated its stale rollouts until the step failed."""
    from tests.rl_actors.test_cluster_sync import _kill_and_wait as kill_and_wait

    cfg = ClusterConfig(generators=3, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    backend = RayBackend(build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR), spread5_reward,
                                          with_reference=False, seed=0))
    try:
        run = RLRun(GEN, num_steps=1, prompts_per_step=PROMPTS, lr_schedule=lambda s: LR, progress=False)
        state = train(backend, make_prompt_source(items, seed=2), constant_schedule(grpo(kl_coef=0.0)), run)
        assert state.policy_version == backend.version == 1 and _same_weights(backend)
        kill_and_wait(ray_local, backend.cluster.generators.group.actors[0])
        assert backend.scale_generators(2)["generators/count"] == 2.0
        assert [f["role"] for f in backend.faults] == ["generator"] and _same_weights(backend)
        state = train(backend, make_prompt_source(items, seed=2), constant_schedule(grpo(kl_coef=0.0)),
                      run._replace(num_steps=2), state=state)
        assert state.policy_version == 2 and state.metrics_history[-1]["staleness/regenerated"] == 0.0
    finally:
        shutdown_cluster(backend.cluster)


def test_shrink_then_grow_refills_the_start_bundles_and_added_workers_are_replaceable(ray_local, tiny_model_path):
    """3 -> 1 -> 4 workers: ranks 1 and 2 come back into the start count's bundles (no new
    placement group for them), rank 3 gets a group of its own; rank 3, killed, is replaced in
    that group; 4 -> 2 removes it. Every worker holds the trainers' weights throughout. A
    policy-tracking (EMA) reference worker is in the weight broadcast too: it rejoins the
    re-formed group each time, and a step's sync after the changes reaches it."""
    from ray.util import placement_group_table

    from cluster.loop.protocol import ActorFailure
    from cluster.ray_wing.pool import release_unclaimed
    from tests.rl_actors.test_cluster_sync import _kill_and_wait as kill_and_wait

    def live_groups() -> int:
        return sum(pg["state"] == "CREATED" for pg in placement_group_table().values())

    cfg = ClusterConfig(generators=3, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    from primitives.maths.kl import create_ema_updater

    backend = RayBackend(build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR), spread5_reward,
                                          with_reference=True, ref_update_fn=create_ema_updater(0.5), seed=0))
    release_unclaimed()  # live_groups counts every placement group in the Ray: none kept for other clusters
    try:
        at_start = live_groups()  # trainer, generator, reward, reference
        assert backend.scale_generators(1)["generators/count"] == 1.0 and live_groups() == at_start
        backend.scale_generators(4)
        group = backend.cluster.generators.group
        assert group.size == 4 and group.slots[:3] == (None, None, None) and group.slots[3] is not None
        assert live_groups() == at_start + 1 and _same_weights(backend)
        kill_and_wait(ray_local, group.actors[3])
        backend.recover(ActorFailure("generator 3 died", "generator", 3, True), since=backend.restarts)
        replaced = backend.cluster.generators.group
        assert replaced.actors[3] != group.actors[3] and replaced.slot(3) == group.slot(3) and _same_weights(backend)
        backend.scale_generators(2)
        assert live_groups() == at_start and backend.cluster.generators.size == 2 and _same_weights(backend)
        c = backend.cluster
        assert c.sync_address.world_size == 1 + 2 + 1  # trainer rank 0, two generators, the reference
        # a step's sync (the reference moves): a rank missing from the re-formed group would stall the broadcast
        assert backend.sync(version=1, step=1, kl=None)["sync/bytes"] > 0 and _same_weights(backend)
        ref = gather([call(c.reference.group, 0, "weight_checksums")], c.timeout_s)[0]
        assert ref == gather(fan_out(c.trainers, "weight_checksums"), c.timeout_s)[0]  # EMA of equal weights
        # a failure of a worker that left is only redone: nothing to replace
        backend.recover(ActorFailure("generator 3 died", "generator", 3, True), since=backend.restarts)
        assert backend.cluster.generators.size == 2
    finally:
        shutdown_cluster(backend.cluster)
