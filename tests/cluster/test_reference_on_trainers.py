"""The reference on the trainer ranks (``cluster.reference_on_trainers``):
every trainer rank holds a copy of the reference and scores its own shard inside the train
step. The same RL steps with a reference worker and with the reference on 2 trainer ranks give
the same metrics (KL included, at T = 0.7) and the same weights; a policy-tracking reference
moves the same way; an algorithm with KL in the reward (REINFORCE++), which needs reference
logprobs before the batch is made, gets them from the trainer ranks as it would from a
reference worker; checkpoints and the copy of the policy reach the trainers' copies."""
import numpy as np
import pytest

from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.handles import ReferenceOnTrainers
from cluster.ray_wing.roles import build_rl_cluster, role_specs, shutdown_cluster
from cluster.ray_wing.weights import copy_policy_to_reference, load_cluster_checkpoint, save_cluster_checkpoint
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo, reinforce_pp
from primitives.maths.kl import create_ema_updater
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_reward

T = 0.7  # a reference scored at 1.0 while the policy scores at 0.7 gives a KL that is not 0


def _train(cluster, steps: int, start=None, algo=None):
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    kwargs = {} if start is None else {"state": start}
    return train(RayBackend(cluster), make_prompt_source(items, seed=1), constant_schedule(algo or grpo(kl_coef=0.05)),
                 RLRun(GenerationConfig(max_new_tokens=4, n=4, temperature=T), num_steps=steps, prompts_per_step=4,
                       lr_schedule=lambda s: 1e-3, progress=False), **kwargs)


def _weights(cluster) -> dict:
    return gather([fan_out(cluster.trainers, "full_state")[0]], 300)[0]


def _build(path, on_trainers: bool):
    cfg = ClusterConfig(generators=1, trainers=2, reward_workers=1, reference_on_trainers=on_trainers,
                        call_timeout_s=300)
    return build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_reward, with_reference=True,
                            ref_update_fn=create_ema_updater(0.5), bucket_mb=0.5)


def _run(cluster) -> dict:
    """3 GRPO steps (KL in the loss), then 2 REINFORCE++ steps (k1 KL in the reward)."""
    grpo_state = _train(cluster, steps=3)
    out = {"grpo": grpo_state.metrics_history, "weights": _weights(cluster)}
    rpp_state = _train(cluster, steps=5, start=grpo_state, algo=reinforce_pp(kl_coef=0.05))
    out.update(rpp=rpp_state.metrics_history[3:], rpp_weights=_weights(cluster), state=rpp_state)
    return out


@pytest.fixture(scope="module")
def worker_run(ray_local, tiny_model_path):
    """The steps with the reference as a worker of its own: the figures to match."""
    cluster = _build(tiny_model_path, on_trainers=False)
    try:
        return _run(cluster)
    finally:
        shutdown_cluster(cluster)  # before the other cluster takes the placement groups' names


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_path, worker_run):
    built = _build(tiny_model_path, on_trainers=True)
    yield built
    shutdown_cluster(built)


@pytest.fixture(scope="module")
def trainer_run(cluster):
    return _run(cluster)


def _same_metrics(ours: list, theirs: list, keys=("loss/total", "loss/kl", "kl/ref_k3", "reward/mean", "grad_norm",
                                                   "policy/entropy")) -> None:
    for mine, other in zip(ours, theirs, strict=True):
        for key in keys:
            assert mine[key] == pytest.approx(other[key], rel=1e-5, abs=1e-7), key


def _same_weights(ours: dict, theirs: dict) -> None:
    assert max(float(np.abs(ours[k] - theirs[k]).max()) for k in ours) < 1e-5


def test_no_reference_role_and_no_reference_in_the_sync_group(cluster):
    names = [r.name for r in role_specs(ClusterConfig(reference_on_trainers=True), with_reference=True)]
    assert names == ["generator", "trainer", "reward"]
    assert isinstance(cluster.reference, ReferenceOnTrainers) and cluster.reference.tracks
    assert cluster.sync_address.world_size == 1 + 1  # trainer rank 0 and the generator
    assert len(gather(fan_out(cluster.trainers, "reference_checksums"), 300)) == 2


def test_same_steps_as_with_a_reference_worker(trainer_run, worker_run, cluster):
    ours, theirs = trainer_run["grpo"], worker_run["grpo"]
    _same_metrics(ours, theirs)
    assert all("time/ref" not in m for m in ours)  # no reference phase: the trainers score inside the train step
    assert ours[0]["kl/ref_k3"] < 1e-7  # the reference is the policy until the first update
    assert ours[1]["kl/ref_k3"] > 1e-6  # then the EMA leaves it halfway behind
    _same_weights(trainer_run["weights"], worker_run["weights"])
    refs = gather(fan_out(cluster.trainers, "reference_checksums"), 300)
    assert refs[0] == refs[1]  # both ranks moved their copies the same way


def test_kl_in_the_reward_scored_by_the_trainer_ranks_before_the_batch(trainer_run, worker_run):
    ours, theirs = trainer_run["rpp"], worker_run["rpp"]
    assert [m["algorithm"] for m in ours] == ["reinforce_pp"] * 2
    _same_metrics(ours, theirs, keys=("loss/total", "kl/ref_k3", "reward/mean", "grad_norm", "policy/entropy"))
    assert all("time/ref" in m for m in ours)  # asked for before the batch, as from a reference worker
    assert all("loss/kl" not in m for m in ours)  # the KL is in the reward, not the loss
    assert all(m["kl/ref_k3"] > 1e-6 for m in ours)  # the EMA reference lags the policy
    _same_weights(trainer_run["rpp_weights"], worker_run["rpp_weights"])


def test_checkpoint_and_policy_copy_reach_every_rank(cluster, trainer_run, tmp_path):
    state = trainer_run["state"]  # after 5 EMA steps: a saved reference != the policy
    saved = gather(fan_out(cluster.trainers, "reference_checksums"), 300)
    path = str(tmp_path / "ckpt")
    save_cluster_checkpoint(cluster, path, state)  # trainer rank 0 writes reference/

    copy_policy_to_reference(cluster)  # each rank copies its own policy
    policy = gather(fan_out(cluster.trainers, "weight_checksums"), 300)[0]
    assert gather(fan_out(cluster.trainers, "reference_checksums"), 300) == [policy, policy] != saved
    _train(cluster, steps=state.iteration + 2, start=state)  # the policy and both copies move on
    load_cluster_checkpoint(cluster, path)  # the sync after the load leaves the reference where it was saved
    assert gather(fan_out(cluster.trainers, "reference_checksums"), 300) == saved
