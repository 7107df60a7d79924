"""Generation on the trainer ranks (``cluster.generate_on_trainers``, veRL's
"hybrid engine"): no generator processes; each trainer rank generates its share of the prompts
with the module it trains. The same RL steps with 2 generator workers and with generation on 2
trainer ranks sample the same tokens and give the same metrics and weights (T = 0.7), since
trainer rank r samples as generator r would; a policy-tracking reference worker still gets
every broadcast; the rollouts carry the last sync's version; what cannot work together is a
named config error."""
import numpy as np
import pytest

from cluster.jobs.checks import rl_errors
from cluster.jobs.config import ClusterConfig, DataConfig, RLConfig, RLJob
from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import ActorFailure, call, fan_out, gather
from cluster.ray_wing.handles import GeneratorsOnTrainers
from cluster.ray_wing.roles import build_rl_cluster, join_weight_sync, role_specs, shutdown_cluster
from cluster.ray_wing.weights import load_cluster_checkpoint, save_cluster_checkpoint, sync_weights
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.maths.kl import create_ema_updater
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_reward

T = 0.7
GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=T)


def _items():
    return make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]


def _train(cluster, steps: int, start=None):
    kwargs = {} if start is None else {"state": start}
    return train(RayBackend(cluster), make_prompt_source(_items(), seed=1), constant_schedule(grpo(kl_coef=0.05)),
                 RLRun(GEN, num_steps=steps, prompts_per_step=4, lr_schedule=lambda s: 1e-3, progress=False), **kwargs)


def _build(path, hosted: bool):
    cfg = ClusterConfig(generators=2, trainers=2, reward_workers=1, generate_on_trainers=hosted, call_timeout_s=300)
    return build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_reward, with_reference=True,
                            ref_update_fn=create_ema_updater(0.5), bucket_mb=0.5)


def _run(cluster) -> dict:
    state = _train(cluster, steps=3)
    weights = gather([fan_out(cluster.trainers, "full_state")[0]], 300)[0]
    reference = gather([call(cluster.reference.group, 0, "weight_checksums")], 300)[0]
    tokens = [r.completion_ids.tolist() for r in gather([cluster.generators.generate(1, _items()[:2], GEN)], 300)[0]]
    return {"metrics": state.metrics_history, "weights": weights, "reference": reference, "state": state,
            "tokens": tokens}


@pytest.fixture(scope="module")
def worker_run(ray_local, tiny_model_path):
    """The steps with 2 generator workers: the figures to match."""
    cluster = _build(tiny_model_path, hosted=False)
    try:
        return _run(cluster)
    finally:
        shutdown_cluster(cluster)


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_path, worker_run):
    built = _build(tiny_model_path, hosted=True)
    yield built
    shutdown_cluster(built)


@pytest.fixture(scope="module")
def hosted_run(cluster):
    return _run(cluster)


def test_no_generator_processes_and_only_the_reference_in_the_sync_group(cluster):
    names = [r.name for r in role_specs(ClusterConfig(generate_on_trainers=True), with_reference=True)]
    assert names == ["trainer", "reward", "reference"]
    assert isinstance(cluster.generators, GeneratorsOnTrainers) and cluster.generators.trainers == cluster.trainers
    assert cluster.sync_address.world_size == 1 + 1  # trainer rank 0 and the tracking reference worker
    infos = gather(cluster.generators.info(), 300)
    assert [i["hosted_by"] for i in infos] == ["trainer 0", "trainer 1"] and {i["backend"] for i in infos} == {"hf"}


def test_same_tokens_metrics_and_weights_as_with_generator_workers(hosted_run, worker_run):
    keys = ("reward/mean", "reward/std", "loss/total", "loss/kl", "kl/ref_k3", "grad_norm", "policy/entropy",
            "response/len_mean")
    for ours, theirs in zip(hosted_run["metrics"], worker_run["metrics"], strict=True):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-8), key
    assert hosted_run["metrics"][2]["grad_norm"] > 0  # the policy moved: step 3 sampled from trained weights
    assert max(float(np.abs(hosted_run["weights"][k] - worker_run["weights"][k]).max())
               for k in hosted_run["weights"]) < 1e-6
    assert hosted_run["reference"] == worker_run["reference"]  # the EMA reference got each broadcast
    assert hosted_run["tokens"] == worker_run["tokens"]  # generator rank 1 after 3 steps: the same tokens
    assert len({tuple(t) for t in hosted_run["tokens"]}) > 1


def test_rollouts_carry_the_synced_version_and_a_sync_with_no_receivers_moves_nothing(cluster, hosted_run):
    version = hosted_run["state"].policy_version
    rollouts = gather([cluster.generators.generate(1, _items()[:1], GEN)], 300)[0]
    assert len(rollouts) == 4 and {r.policy_version for r in rollouts} == {version} and version == 3
    # without the tracking reference worker there is no one to send to: no group, no broadcast
    alone = join_weight_sync(cluster._replace(reference=None))
    assert alone.sync_address.world_size == 1
    assert sync_weights(alone, version + 4)["sync/bytes"] == 0
    rollouts = gather([cluster.generators.generate(0, _items()[:1], GEN)], 300)[0]
    assert {r.policy_version for r in rollouts} == {version + 4}
    sync_weights(cluster, version, move_reference=False)  # back as it was, for the next test


def test_a_checkpoint_load_restamps_the_version(cluster, hosted_run, tmp_path):
    state = hosted_run["state"]
    path = str(tmp_path / "ckpt")
    save_cluster_checkpoint(cluster, path, state)
    saved = gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0]
    later = _train(cluster, steps=state.iteration + 1, start=state)
    assert later.policy_version == state.policy_version + 1
    assert gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0] != saved  # it generated from new weights
    assert load_cluster_checkpoint(cluster, path).policy_version == state.policy_version
    assert gather([call(cluster.trainers, 0, "weight_checksums")], 300)[0] == saved  # and from the loaded ones
    rollouts = gather([cluster.generators.generate(0, _items()[:1], GEN)], 300)[0]
    assert {r.policy_version for r in rollouts} == {state.policy_version}


def test_a_failure_names_the_trainer_and_is_not_replaced_without_a_snapshot(cluster, hosted_run):
    """A raising generation names the trainer and is never retried; a dead trainer rank is rebuilt
    only from a snapshot (``tests/cluster/test_fault_recovery.py``): before the first, it is re-raised."""
    with pytest.raises(ActorFailure, match=r"trainer 1 failed in generate") as e:
        gather([cluster.generators.generate(1, ["not a prompt item"], GEN)], 300)
    assert e.value.role == "trainer" and not e.value.replaceable
    backend = RayBackend(cluster)
    dead = ActorFailure("trainer 1 died during generator.generate", "trainer", 1, died=True)
    with pytest.raises(ActorFailure, match="trainer 1 died .*no snapshot yet"):
        backend.recover(dead, since=0)  # re-raised: nothing replaced
    assert backend.cluster is cluster and backend.restarts == 0


def test_generating_counts_as_the_trainer_being_busy(cluster, hosted_run):
    gather(fan_out(cluster.trainers, "busy") + cluster.generators.busy(), 300)  # both clocks at 0
    gather([cluster.generators.generate(0, _items()[:4], GEN)], 300)
    trainer, generator = gather([call(cluster.trainers, 0, "busy"), cluster.generators.busy()[0]], 300)
    assert generator > 0 and trainer == generator  # one process: busy while it generates


@pytest.mark.parametrize("change, message", [
    ({"cluster": ClusterConfig(generate_on_trainers=True, zero_stage=3)}, "needs cluster.zero_stage 1 or 2"),
    ({"cluster": ClusterConfig(generate_on_trainers=True, generator_backend="vllm")}, "needs generator workers"),
    ({"cluster": ClusterConfig(generate_on_trainers=True), "algorithm": RLConfig(max_staleness=1)},
     "algorithm.max_staleness 1 overlaps generation with training"),
])
def test_what_cannot_work_with_generation_on_the_trainers_is_a_named_error(change, message):
    job = RLJob(data=DataConfig(task="arithmetic"), **change)
    assert any(message in e for e in rl_errors(job)), rl_errors(job)
    assert not rl_errors(RLJob(data=DataConfig(task="arithmetic"),
                               cluster=ClusterConfig(generate_on_trainers=True, generators=0)))


def test_a_trainer_built_from_python_refuses_to_host_a_generator_under_zero3(tiny_model_path):
    from rl_actors.common import GENERATE_ON_ZERO3
    from rl_actors.trainer import TrainerWorker

    with pytest.raises(ValueError, match="trainer 0: cluster.generate_on_trainers needs cluster.zero_stage 1 or 2"):
        TrainerWorker(tiny_model_path, 0, 1, TrainerConfig(zero_stage=3), host_generator=True)
    job = RLJob(data=DataConfig(task="arithmetic"), cluster=ClusterConfig(generate_on_trainers=True, zero_stage=3))
    assert GENERATE_ON_ZERO3 in rl_errors(job)  # the same words before Ray starts
