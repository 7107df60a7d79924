"""The reference on the trainer ranks (issue 9, item 2: ``cluster.reference_on_trainers``):
every trainer rank holds a copy of the reference and scores its own shard inside the train
step. The same RL steps with a reference worker and with the reference on 2 trainer ranks give
the same metrics (KL included, at T = 0.7) and the same weights; a policy-tracking reference
moves the same way; checkpoints and the copy of the policy reach the trainers' copies; and a
job that puts KL in the reward, which needs reference logprobs before the train step, is
refused before anything starts."""
import numpy as np
import pytest

from cluster.config import ClusterConfig, DataConfig, RLConfig, RLJob
from cluster.driver import copy_policy_to_reference, gather, load_cluster_checkpoint, save_cluster_checkpoint, train
from cluster.groups import fan_out
from cluster.job import rl_errors
from cluster.setup import build_rl_cluster, role_specs, shutdown_cluster
from primitives.algorithms import constant_schedule, grpo
from primitives.data import make_prompt_source
from primitives.kl import create_ema_updater
from primitives.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig

T = 0.7  # a reference scored at 1.0 while the policy scores at 0.7 gives a KL that is not 0


def spread_reward(rollout) -> float:
    """Rewards that vary with the sampled tokens, so that groups have spread and the policy moves."""
    return float(int(rollout.completion_ids.sum()) % 3)


def _train(cluster, steps: int, start=None):
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    kwargs = {} if start is None else {"state": start}
    return train(cluster, make_prompt_source(items, seed=1), constant_schedule(grpo(kl_coef=0.05)),
                 GenerationConfig(max_new_tokens=4, n=4, temperature=T), num_steps=steps, prompts_per_step=4,
                 lr_schedule=lambda s: 1e-3, progress=False, **kwargs)


def _weights(cluster) -> dict:
    return gather([fan_out(cluster.trainers, "full_state")[0]], 300)[0]


def _build(path, on_trainers: bool):
    cfg = ClusterConfig(generators=1, trainers=2, reward_workers=1, reference_on_trainers=on_trainers,
                        call_timeout_s=300)
    return build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_reward, with_reference=True,
                            ref_update_fn=create_ema_updater(0.5), bucket_mb=0.5)


@pytest.fixture(scope="module")
def worker_run(ray_local, tiny_model_path):
    """3 RL steps with the reference as a worker of its own: the figures to match."""
    cluster = _build(tiny_model_path, on_trainers=False)
    try:
        state = _train(cluster, steps=3)
        return state, _weights(cluster), gather([fan_out(cluster.reference, "weight_checksums")[0]], 300)[0]
    finally:
        shutdown_cluster(cluster)  # before the other cluster takes the placement groups' names


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_path, worker_run):
    built = _build(tiny_model_path, on_trainers=True)
    yield built
    shutdown_cluster(built)


def test_no_reference_role_and_no_reference_in_the_sync_group(cluster):
    names = [r.name for r in role_specs(ClusterConfig(reference_on_trainers=True), with_reference=True)]
    assert names == ["generator", "trainer", "reward"]
    assert cluster.reference is None and cluster.reference_on_trainers and cluster.reference_tracks_policy
    assert cluster.sync_address.world_size == 1 + 1  # trainer rank 0 and the generator
    assert len(gather(fan_out(cluster.trainers, "reference_checksums"), 300)) == 2


def test_same_steps_as_with_a_reference_worker(cluster, worker_run):
    worker_state, worker_weights, worker_ref = worker_run
    state = _train(cluster, steps=3)
    for ours, theirs in zip(state.metrics_history, worker_state.metrics_history, strict=True):
        for key in ("loss/total", "loss/kl", "kl/ref_k3", "reward/mean", "grad_norm", "policy/entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        assert "time/ref" not in ours  # no reference phase: the trainers score inside the train step
    assert state.metrics_history[0]["kl/ref_k3"] < 1e-7  # the reference is the policy until the first update
    assert state.metrics_history[1]["kl/ref_k3"] > 1e-6  # then the EMA leaves it halfway behind
    weights = _weights(cluster)
    assert max(float(np.abs(weights[k] - worker_weights[k]).max()) for k in weights) < 1e-5
    refs = gather(fan_out(cluster.trainers, "reference_checksums"), 300)
    assert refs[0] == refs[1]  # both ranks moved their copies the same way
    assert refs[0].keys() == worker_ref.keys()


def test_checkpoint_and_policy_copy_reach_every_rank(cluster, tmp_path):
    state = _train(cluster, steps=4)  # one more step after the first test: a saved reference != the policy
    saved = gather(fan_out(cluster.trainers, "reference_checksums"), 300)
    path = str(tmp_path / "ckpt")
    save_cluster_checkpoint(cluster, path, state)  # trainer rank 0 writes reference/

    copy_policy_to_reference(cluster)  # each rank copies its own policy
    policy = gather(fan_out(cluster.trainers, "weight_checksums"), 300)[0]
    assert gather(fan_out(cluster.trainers, "reference_checksums"), 300) == [policy, policy] != saved
    _train(cluster, steps=5, start=state)
    load_cluster_checkpoint(cluster, path)  # the sync after the load leaves the reference where it was saved
    assert gather(fan_out(cluster.trainers, "reference_checksums"), 300) == saved


def test_kl_in_the_reward_is_refused_before_anything_starts(tmp_path, tiny_model_path):
    from cluster.cli import run
    from primitives.rewards import kl_penalty_shaping

    job = RLJob(data=DataConfig(task="arithmetic"), algorithm=RLConfig(name="reinforce_pp"),
                cluster=ClusterConfig(reference_on_trainers=True))
    assert any("cluster.reference_on_trainers: 'reinforce_pp' puts KL in the reward" in e for e in rl_errors(job))
    with pytest.raises(SystemExit, match="reference_on_trainers"):
        run(["rl", "--data.task", "arithmetic", "--algorithm.name", "reinforce_pp",
             "--cluster.reference-on-trainers", "True", "--logging.out", str(tmp_path)])
    with pytest.raises(ValueError, match="shaping function reads reference logprobs"):
        build_rl_cluster(tiny_model_path, ClusterConfig(reference_on_trainers=True), TrainerConfig(), spread_reward,
                         with_reference=True, shaping_fn=kl_penalty_shaping(0.1))
