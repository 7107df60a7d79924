"""N reference workers: ``cluster.reference_workers`` ranks of the reference.
A policy-tracking reference has every rank in the weight-sync group; every rank holds the same
weights after each sync, after a copy of the policy and after a checkpoint is loaded."""
import pytest

from cluster.jobs.checks import rl_errors
from cluster.jobs.config import ClusterConfig, DataConfig, RLJob
from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, role_specs, shutdown_cluster
from cluster.ray_wing.weights import copy_policy_to_reference, load_cluster_checkpoint, save_cluster_checkpoint
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.maths.kl import create_ema_updater
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_reward


def test_one_reference_worker_by_default_and_n_when_asked():
    def count(cfg):
        return {r.name: r.count for r in role_specs(cfg, with_reference=True)}["reference"]

    assert count(ClusterConfig()) == 1
    assert count(ClusterConfig(reference_workers=3)) == 3


def test_zero_reference_workers_is_a_config_error_naming_the_field(tmp_path):
    job = RLJob(data=DataConfig(task="arithmetic"), cluster=ClusterConfig(reference_workers=0))
    assert "cluster.reference_workers must be at least 1, got 0" in rl_errors(job)

    from cluster.jobs.cli import run

    with pytest.raises(SystemExit, match="cluster.reference_workers must be at least 1, got 0"):
        run(["rl", "--data.task", "arithmetic", "--cluster.reference-workers", "0", "--logging.out", str(tmp_path)])


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_path):
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, reference_workers=2, zero_stage=2,
                        call_timeout_s=300)
    built = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_reward,
                             with_reference=True, ref_update_fn=create_ema_updater(0.5), bucket_mb=0.5)
    yield built
    shutdown_cluster(built)


def _checksums(group) -> list:
    return gather(fan_out(group, "weight_checksums"), 300)


def _train(cluster, steps: int, start=None):
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    kwargs = {} if start is None else {"state": start}
    return train(RayBackend(cluster), make_prompt_source(items, seed=1), constant_schedule(grpo(kl_coef=0.05)),
                 RLRun(GenerationConfig(max_new_tokens=4, n=4), num_steps=steps, prompts_per_step=4,
                       lr_schedule=lambda s: 1e-3, progress=False), **kwargs)


def test_every_reference_rank_joins_the_weight_sync_group(cluster):
    assert cluster.reference.size == 2 and cluster.reference.tracks
    assert cluster.sync_address.world_size == 1 + 1 + 2  # trainer rank 0, the generator, both reference ranks


def test_reference_ranks_hold_identical_weights_after_syncs_copies_and_loads(cluster, tmp_path):
    start = _checksums(cluster.reference.group)
    assert start[0] == start[1]
    state = _train(cluster, steps=2)  # two syncs: each reference rank applies the same EMA update
    refs, trainer = _checksums(cluster.reference.group), _checksums(cluster.trainers)[0]
    assert refs[0] == refs[1]
    assert refs[0] != start[0] and refs[0] != trainer  # moved towards the policy, halfway (EMA 0.5)

    path = str(tmp_path / "ckpt")
    save_cluster_checkpoint(cluster, path, state)  # reference rank 0 writes reference/

    copy_policy_to_reference(cluster)  # one object to every rank
    assert _checksums(cluster.reference.group) == [trainer, trainer]
    _train(cluster, steps=3, start=state)  # the trainer and both references move on
    assert _checksums(cluster.reference.group)[0] not in (trainer, refs[0])
    # every rank loads it; the sync after the load refreshes the generator and leaves the
    # reference where it was saved (an EMA step there would move it towards the policy)
    load_cluster_checkpoint(cluster, path)
    assert _checksums(cluster.reference.group) == refs
    assert _checksums(cluster.trainers)[0] == trainer
    assert _checksums(cluster.generators.group)[0] == trainer


def test_a_member_dead_as_the_sync_group_forms_frees_the_others_at_once(ray_local, cluster):
    """Last in this module: it kills the generator. The weight-sync group is formed again with the
    dead generator among its members: the join fails naming it, and the driver gives the group up,
    so trainer rank 0 and both reference ranks, which wait in the rendezvous for the generator,
    leave it and answer at once. Before, they waited out the rendezvous's 300 s timeout, and the
    recovery's next call to trainer rank 0 timed out (a chaos run failed so). The generator
    replaced, the group forms again, and the given-up group's mark leaves Ray's key-value store;
    the sync reaches the new generator and leaves the references where they were."""
    import time

    from ray.exceptions import RayActorError
    from ray.experimental.internal_kv import _internal_kv_list

    from cluster.ray_wing.groups import ActorFailure, call
    from cluster.ray_wing.replace import swap_actor
    from cluster.ray_wing.roles import join_weight_sync
    from cluster.ray_wing.weights import sync_weights
    from rl_actors.weight_sync import ABANDONED_KEY

    refs = _checksums(cluster.reference.group)
    marks = set(_internal_kv_list(ABANDONED_KEY))
    dead = cluster.generators.group.actors[0]
    ray_local.kill(dead, no_restart=True)
    with pytest.raises(RayActorError):
        for _ in range(100):  # ray.kill is asynchronous: until calls on it fail
            ray_local.get(dead.info.remote(), timeout=10)
            time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(ActorFailure, match="generator 0 died during init_weight_sync"):
        join_weight_sync(cluster)
    gather([call(cluster.trainers, 0, "endpoint")] + fan_out(cluster.reference.group, "info"), 30)
    assert time.monotonic() - t0 < 30
    assert len(set(_internal_kv_list(ABANDONED_KEY)) - marks) == 1  # the given-up group's mark
    replaced = join_weight_sync(swap_actor(cluster, "generator", 0))
    assert set(_internal_kv_list(ABANDONED_KEY)) <= marks  # read no more once a group formed after it: deleted
    sync_weights(replaced, version=1, move_reference=False)
    assert _checksums(replaced.generators.group) == _checksums(replaced.trainers)
    assert _checksums(replaced.reference.group) == refs
