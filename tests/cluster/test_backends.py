"""One RL loop, two backends (DESIGN invariant 7): the same seed and config give the same
metrics on the local backend (one process, plain torch, no Ray) and on a 1-generator,
1-trainer Ray cluster (DeepSpeed ZeRO-2, gloo)."""
import numpy as np
import pytest

from cluster.config import ClusterConfig
from cluster.driver import train
from cluster.local import LocalBackend
from cluster.ray_backend import RayBackend
from cluster.setup import build_rl_cluster, shutdown_cluster
from primitives.algorithms import constant_schedule, grpo
from primitives.data import make_prompt_source
from primitives.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig

GEN = GenerationConfig(max_new_tokens=4, n=4, temperature=0.9)
STEPS, PROMPTS, LR = 3, 4, 1e-3


def spread_reward(rollout) -> float:
    """Varies with the sampled tokens, so a random model's groups have spread to learn from."""
    return float(int(rollout.completion_ids.sum()) % 3) + arithmetic_reward(rollout)


def _train(backend, steps=STEPS, state=None, algo=None):
    from primitives.types import TrainState

    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    return train(backend, make_prompt_source(items, seed=5), constant_schedule(algo or grpo(kl_coef=0.05)), GEN,
                 steps, PROMPTS, lambda step: LR, state=state or TrainState(), progress=False)


def _run(backend, steps=STEPS, algo=None):
    return list(_train(backend, steps, algo=algo).metrics_history)


def _comparable(m: dict) -> dict:
    """Numbers that must agree: not timings, not the bytes a Ray sync moved."""
    return {k: v for k, v in m.items() if not k.startswith("time/") and k != "sync/bytes"}


@pytest.fixture(scope="module")
def local_metrics(tiny_model_path):
    backend = LocalBackend(tiny_model_path, spread_reward, with_reference=True,
                           trainer=TrainerConfig(lr=LR, max_grad_norm=1.0), seed=0)
    return _run(backend)


def test_local_backend_runs_the_loop(local_metrics):
    assert len(local_metrics) == STEPS and local_metrics[-1]["sync/version"] == STEPS
    assert all(m["batch/rows"] == PROMPTS * GEN.n for m in local_metrics)
    assert local_metrics[0]["kl/ref_k3"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before step 1
    assert local_metrics[-1]["kl/ref_k3"] > 1e-6  # and apart after two updates


def test_local_backend_resumes_exactly(tiny_model_path, tmp_path):
    """PPO with an EMA reference on the local backend: 3 steps straight equal 2 steps, save,
    a fresh backend loading the checkpoint, 1 more step (policy, optimizer, critic,
    reference and RNG all restored)."""
    from primitives.algorithms import ppo
    from primitives.kl import create_ema_updater

    def backend():
        return LocalBackend(tiny_model_path, spread_reward, with_reference=True, ref_update_fn=create_ema_updater(0.5),
                            trainer=TrainerConfig(lr=LR), critic="policy", seed=0)

    algo = ppo(kl_coef=0.05)
    straight = _run(backend(), steps=3, algo=algo)
    first = backend()
    first.save(str(tmp_path / "ckpt"), _train(first, steps=2, algo=algo))
    second = backend()
    resumed = _train(second, steps=3, state=second.load(str(tmp_path / "ckpt")), algo=algo)
    _assert_same(straight, list(resumed.metrics_history))


def test_same_seed_same_metrics_on_local_and_ray(ray_local, tiny_model_path, local_metrics):
    cfg = ClusterConfig(generators=1, trainers=1, reward_workers=1, zero_stage=2, call_timeout_s=300)
    cluster = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0),
                               spread_reward, with_reference=True, seed=0)
    try:
        ray_metrics = _run(RayBackend(cluster))
    finally:
        shutdown_cluster(cluster)
    _assert_same(local_metrics, ray_metrics)
    assert ray_metrics[-1]["reward/mean"] == local_metrics[-1]["reward/mean"]  # the same tokens were sampled


# ----------------------------------------------------------------------------- PPO with a critic
PPO_STEPS = 3


def _run_ppo(backend):
    from primitives.algorithms import ppo

    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
    state = train(backend, make_prompt_source(items, seed=5), constant_schedule(ppo(kl_coef=0.05)), GEN, PPO_STEPS,
                  PROMPTS, lambda step: LR, progress=False)
    return list(state.metrics_history)


def _assert_same(first, second):
    for step, (a, b) in enumerate(zip(first, second)):
        a, b = _comparable(a), _comparable(b)
        assert set(a) == set(b), f"step {step}: keys differ {set(a) ^ set(b)}"
        for key in a:
            if isinstance(a[key], str):
                assert a[key] == b[key], (step, key)
            else:
                assert np.isclose(a[key], b[key], rtol=1e-5, atol=1e-5), (step, key, a[key], b[key])


def test_ppo_critic_on_one_process_equals_two_trainer_and_two_critic_ranks(ray_local, tiny_model_path):
    """PPO (GAE on the critic's values, k1 KL in the reward): the local backend (one policy, one
    value model) and a Ray cluster with 2 trainer ranks and 2 critic ranks log the same numbers,
    the critic's included."""
    from cluster.setup import add_critics
    from primitives.types import ModelConfig

    local = _run_ppo(LocalBackend(tiny_model_path, spread_reward, with_reference=True,
                                  trainer=TrainerConfig(lr=LR, max_grad_norm=1.0), critic="policy", seed=0))
    assert all(m["critic/value_loss"] > 0 for m in local) and "critic/grad_norm" in local[0]
    cfg = ClusterConfig(generators=1, trainers=2, critics=2, reward_workers=1, zero_stage=2, call_timeout_s=300)
    trainer_cfg = TrainerConfig(zero_stage=2, lr=LR, max_grad_norm=1.0)
    cluster = build_rl_cluster(tiny_model_path, cfg, trainer_cfg, spread_reward, with_reference=True, seed=0)
    try:
        cluster = add_critics(cluster, ModelConfig(tiny_model_path), cfg, trainer_cfg)
        ray_metrics = _run_ppo(RayBackend(cluster))
    finally:
        shutdown_cluster(cluster)
    _assert_same(local, ray_metrics)
