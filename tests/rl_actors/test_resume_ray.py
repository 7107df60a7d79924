"""Invariant 4 on Ray: N steps straight == N/2 steps, checkpoint, a fresh cluster, resume,
N/2 steps - same trainer weights and same metrics (CPU, fp32, ZeRO-2 over 2 ranks, with a
reference worker)."""
import numpy as np
import pytest

from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import load_cluster_checkpoint, save_cluster_checkpoint, sync_weights
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig, TrainState
from rl_actors.trainer import TrainerConfig
from tests.rewards import spread_reward

ITEMS = make_arithmetic_task(ArithmeticTaskSpec(num_train=16, num_heldout=1, seed=3))[0]
KEYS = ("loss/policy", "reward/mean", "grad_norm", "kl/ref_k3", "batch/loss_tokens")


def _cluster(path):
    cfg = ClusterConfig(generators=2, trainers=2, zero_stage=2, call_timeout_s=300)
    return build_rl_cluster(path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), spread_reward, with_reference=True)


def _train(cluster, state, until):
    return train(RayBackend(cluster), make_prompt_source(ITEMS, seed=4), constant_schedule(grpo(kl_coef=0.05)),
                 RLRun(GenerationConfig(max_new_tokens=4, n=3), num_steps=until, prompts_per_step=4,
                       lr_schedule=lambda s: 1e-3, progress=False),
                 state=state)


def _weights(cluster):
    return gather(fan_out(cluster.trainers, "full_state"), cluster.timeout_s)[0]


@pytest.mark.slow
def test_resumed_run_equals_continuous_run(ray_local, tiny_model_path, tmp_path):
    cluster = _cluster(tiny_model_path)
    try:
        sync_weights(cluster, 0)
        straight = _train(cluster, TrainState(), 4)
        w_straight = _weights(cluster)
    finally:
        shutdown_cluster(cluster)

    cluster = _cluster(tiny_model_path)
    try:
        sync_weights(cluster, 0)
        half = _train(cluster, TrainState(), 2)
        ckpt = save_cluster_checkpoint(cluster, str(tmp_path / "ckpt"), half)
    finally:
        shutdown_cluster(cluster)

    cluster = _cluster(tiny_model_path)  # fresh actors: everything must come from the checkpoint
    try:
        state = load_cluster_checkpoint(cluster, ckpt)
        assert (state.iteration, state.policy_version, state.data_position) == (2, 2, half.data_position)
        resumed = _train(cluster, state, 4)
        w_resumed = _weights(cluster)
    finally:
        shutdown_cluster(cluster)

    assert len(resumed.metrics_history) == len(straight.metrics_history) == 4
    for a, b in zip(straight.metrics_history, resumed.metrics_history):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    worst = max(float(np.abs(w_straight[n] - w_resumed[n]).max()) for n in w_straight)
    assert worst < 1e-6, f"resumed weights differ from continuous by {worst}"
    moved = max(float(np.abs(w_straight[n] - v).max()) for n, v in _base(tiny_model_path).items())
    assert moved > 1e-4  # four real updates happened


def _base(path):
    from transformers import AutoModelForCausalLM

    return {n: p.detach().numpy() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}
