"""On Ray, through the driver: one sampling temperature (T = 0.7) - generator, trainer and
reference all score ``softmax(logits / 0.7)``; KL shaping in the reward sees reference
logprobs; the generator / trainer gap is measured every step and is fp32-small on CPU; and
``train`` / ``train_sft`` log the same numbers on 1 and 2 trainer ranks."""
import numpy as np
import pytest

from cluster.loop.sft import SFTRun, train_sft
from cluster.loop.train import Hooks, RLRun, collect, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import sync_weights
from primitives.env.rewards import kl_penalty_shaping
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task, sft_demonstrations
from primitives.io.data import make_prompt_source, prepare_sft_text
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig, ModelConfig
from rl_actors.trainer import TrainerConfig

T = 0.7
KL_SHAPING = 0.1


def _one_step_each(path, trainers: int):
    """A cluster with ``trainers`` ranks: one RL step at T = 0.7 while policy == reference, then
    one SFT step, then a sync. Returns ``(cluster, logged RL metrics, logged SFT metrics, items)``."""
    from transformers import AutoTokenizer

    cfg = ClusterConfig(generators=1, trainers=trainers, zero_stage=2, call_timeout_s=300)
    # a fixed reference loaded from the same weights: policy == reference until the first update;
    # the model config (eager attention, not the default sdpa) must reach every actor
    model = ModelConfig(path, attn_implementation="eager")
    cluster = build_rl_cluster(model, cfg, TrainerConfig(zero_stage=2, lr=1e-2, micro_batch_size=5), arithmetic_reward,
                               with_reference=True, shaping_fn=kl_penalty_shaping(KL_SHAPING))
    spec = ArithmeticTaskSpec(num_train=32, num_heldout=1)
    items = make_arithmetic_task(spec)[0]
    rl, sft = [], []
    train(RayBackend(cluster), make_prompt_source(items), constant_schedule(grpo(kl_coef=0.05)),
          RLRun(GenerationConfig(max_new_tokens=4, n=4, temperature=T), num_steps=1, prompts_per_step=4,
                lr_schedule=lambda s: 1e-2, progress=False),
          hooks=Hooks(logger=rl.append))
    tok = AutoTokenizer.from_pretrained(path)
    samples = [prepare_sft_text(tok, p, c) for p, c in sft_demonstrations(items, spec)[0]]
    train_sft(RayBackend(cluster), samples, SFTRun(1, 16, lambda s: 1e-3, progress=False), Hooks(logger=sft.append))
    sync_weights(cluster, version=2)
    return cluster, rl[0], sft[0], items


@pytest.fixture(scope="module")
def runs(ray_local, tiny_model_path):
    """The same steps on 1 and on 2 trainer ranks (one generator each: the same rollouts)."""
    one = _one_step_each(tiny_model_path, 1)
    shutdown_cluster(one[0])
    two = _one_step_each(tiny_model_path, 2)
    yield one, two
    shutdown_cluster(two[0])


@pytest.fixture(scope="module")
def cluster(runs):
    return runs[1][0]


@pytest.fixture(scope="module")
def first_step(runs):
    _, metrics, _, items = runs[1]
    return metrics, items


def test_the_driver_logs_the_same_numbers_on_1_and_2_ranks(runs):
    """Invariant 6 through ``train`` and ``train_sft`` themselves (their merge of the ranks)."""
    (_, rl1, sft1, _), (_, rl2, sft2, _) = runs
    for key in ("loss/policy", "loss/kl", "kl/ref_k3", "policy/entropy", "policy/clip_frac", "policy/ratio_mean",
                "grad_norm", "mismatch/k3", "mismatch/max_abs_logp_diff", "mismatch/is_weight_mean", "reward/mean"):
        assert rl2[key] == pytest.approx(rl1[key], abs=1e-6), (key, rl2[key], rl1[key])
    assert rl1["policy/entropy"] > 0.1 and rl1["grad_norm"] > 0  # real values, not zeros
    for key in ("loss/sft", "sft/tokens"):
        assert sft2[key] == pytest.approx(sft1[key], rel=1e-6), (key, sft2[key], sft1[key])
    # a norm over 0.6M summed gradients: float32 rounding of another summation order is ~1e-6 of it
    assert sft2["grad_norm"] == pytest.approx(sft1["grad_norm"], rel=1e-5), (sft2["grad_norm"], sft1["grad_norm"])
    assert sft1["loss/sft"] > 1.0


def test_the_model_config_reaches_every_actor(cluster):
    groups = [cluster.generators.group, cluster.trainers, cluster.reference.group]
    infos = gather([c for g in groups for c in fan_out(g, "info")], cluster.timeout_s)
    assert [i["role"] for i in infos] == ["generator", "trainer", "trainer", "reference"]
    for info in infos:
        assert info["model"] == {"dtype": "float32", "device": "cpu", "attn_implementation": "eager",
                                 "gradient_checkpointing": False}, info


def test_kl_to_an_identical_reference_is_zero_at_t07(first_step):
    metrics, _ = first_step
    assert metrics["kl/ref_k3"] < 1e-7  # a reference scored at T=1 fails this (checked by mutation)
    assert metrics["mismatch/k3"] < 1e-6
    assert metrics["mismatch/max_abs_logp_diff"] < 1e-4
    assert metrics["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch/is_clipped_frac"] == 0.0


def test_generator_reference_and_trainer_score_at_the_sampling_temperature(cluster, first_step, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from primitives.model.logprobs import rollout_logprobs

    _, items = first_step
    rollouts, _ = collect(RayBackend(cluster), items[:4], GenerationConfig(max_new_tokens=4, n=2, temperature=T),
                          with_ref=True)
    assert {r.policy_version for r in rollouts} == {2}  # after the RL and SFT steps and their sync
    trainer = gather(fan_out(cluster.trainers, "logprobs", rollouts, T), cluster.timeout_s)[0]
    assert max(float(np.abs(t - r.logprobs).max()) for t, r in zip(trainer, rollouts)) < 1e-4
    # the fixed reference is the initial model, scored at T = 0.7 (not 1.0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    at_t = rollout_logprobs(base, rollouts, cluster.pad_token_id, T)
    at_1 = rollout_logprobs(base, rollouts, cluster.pad_token_id, 1.0)
    assert max(float(np.abs(a - r.ref_logprobs).max()) for a, r in zip(at_t, rollouts)) < 1e-5
    assert max(float(np.abs(a - r.ref_logprobs).max()) for a, r in zip(at_1, rollouts)) > 1e-2
    # KL shaping ran on the reward worker after the reference: reward = task - coef * sum(k1)
    shaped = [arithmetic_reward(r) - KL_SHAPING * float(((r.logprobs - r.ref_logprobs) * r.loss_mask).sum())
              for r in rollouts]
    assert [r.reward for r in rollouts] == pytest.approx(shaped, abs=1e-6)
    assert max(abs(r.reward - arithmetic_reward(r)) for r in rollouts) > 1e-4  # the policy has moved


def test_rl_refuses_a_non_positive_temperature_before_any_work(cluster):
    with pytest.raises(ValueError, match="temperature > 0"):
        train(RayBackend(cluster), lambda position, n: (_ for _ in ()).throw(AssertionError("no prompt may be drawn")),
              constant_schedule(grpo()),
              RLRun(GenerationConfig(temperature=0.0, n=4), num_steps=1, prompts_per_step=1, lr_schedule=lambda s: 1e-3,
                    progress=False))
