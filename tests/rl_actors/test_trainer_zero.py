"""Invariant 2 on real DeepSpeed: ZeRO-1, 2 and 3 over 2 ranks give the single-process loss
and the single-process updated weights for the same batch."""

import numpy as np
import pytest
import torch

from primitives.maths.algorithms import dapo, grpo
from primitives.maths.batching import make_batch
from primitives.model.training import forward_backward, optim_step, step_counts
from primitives.types import ModelConfig
from rl_actors.trainer import TrainerConfig, TrainerWorker
from tests.actors import done, rendezvous, start_ranks
from tests.conftest import scored_rollouts

LR = 1e-3
# Adam's first update is lr * g / (|g| + eps): where |g| is near eps, a rounding-sized change
# of g (another summation order over ranks) moves it by up to lr * dg / (4 eps). With torch's
# 1e-8 that is a few % of lr on one CPU and more on another; 1e-6 bounds it by 0.1 % of lr for
# the float32 rounding of these gradients, so the comparison below tests the gradients, not the CPU.
EPS = 1e-6


def _single_process(path, batch, algo):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    metrics = forward_backward(model, batch, algo, step_counts(batch), micro_batch_size=5)
    grad_norm = optim_step(model, opt, max_grad_norm=1.0)
    return metrics["loss/policy"], grad_norm, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _compare_weights(got, expected, what):
    """Every weight within 2 % of lr of the one-process weight (see ``EPS``), and the mean
    difference far smaller."""
    diffs = np.concatenate([np.abs(got[n] - w).ravel() for n, w in expected.items()])
    assert diffs.max() < 0.02 * LR, f"{what}: weights differ by up to {diffs.max()}"
    assert diffs.mean() < 1e-3 * LR, f"{what}: mean weight difference {diffs.mean()}"


def _trainer_group(ray, path, stage, world=2):
    # micro-batches of 3: several per rank
    cfg = TrainerConfig(zero_stage=stage, lr=LR, micro_batch_size=3, max_grad_norm=1.0, adam_eps=EPS)
    actors = start_ranks(ray, TrainerWorker, [((ModelConfig(path), r, world, cfg, 0), {}) for r in range(world)])
    rendezvous(ray, actors)
    return actors


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_single_process(ray_local, tiny_model_path, stage):
    rollouts, tok = scored_rollouts(tiny_model_path)
    algo = dapo(overlong_buffer_frac=0.5)  # token-mean + clip-higher
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    batch = batch._replace(old_logprobs=batch.behaviour_logprobs - 0.05 * batch.loss_mask)  # ratios != 1
    ref_loss, ref_norm, ref_weights = _single_process(tiny_model_path, batch, algo)

    actors = _trainer_group(ray_local, tiny_model_path, stage)
    try:
        stats = [u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
        states = ray_local.get([a.full_state.remote() for a in actors], timeout=300)
    finally:
        done(ray_local, actors)
    sharded_loss = sum(s["loss/policy"] for s in stats)  # each rank's share of the global loss
    assert sharded_loss == pytest.approx(ref_loss, abs=1e-6)
    assert stats[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # the reduced gradient is the global one
    assert ref_norm > 1.0  # so clipping to 1.0 was exercised too
    _compare_weights(states[0], ref_weights, f"ZeRO-{stage}")
    for n in ref_weights:  # every rank holds the same model after the step
        assert np.array_equal(states[0][n], states[1][n])
    moved = max(float(np.abs(states[0][n] - w).max()) for n, w in
                _initial(tiny_model_path).items())
    assert moved > 1e-4  # the step really changed the weights


def _initial(path):
    from transformers import AutoModelForCausalLM

    return {n: p.detach().numpy() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


def test_grpo_with_kl_and_three_ranks(ray_local, tiny_model_path):
    """Uneven shards (16 rows over 3 ranks) with KL in the loss: still the global loss."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    rollouts = [r._replace(ref_logprobs=r.logprobs - 0.1) for r in rollouts]
    algo = grpo(kl_coef=0.05)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    ref_loss, ref_norm, ref_weights = _single_process(tiny_model_path, batch, algo)
    actors = _trainer_group(ray_local, tiny_model_path, 2, world=3)
    try:
        stats = [u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
        state = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
    finally:
        done(ray_local, actors)
    assert sum(s["loss/policy"] for s in stats) == pytest.approx(ref_loss, abs=1e-6)
    assert sum(s["loss/kl"] for s in stats) > 0
    assert stats[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    _compare_weights(state, ref_weights, "ZeRO-2 over 3 ranks")


KEYS = ("loss/policy", "loss/kl", "kl/ref_k3", "policy/entropy", "policy/clip_frac", "policy/ratio_mean",
        "grad_norm", "mismatch/k3", "mismatch/max_abs_logp_diff", "mismatch/is_weight_mean",
        "mismatch/is_clipped_frac")


def _logged(ray, path, batch, algo, world):
    """What the driver logs for ``batch`` on a ``world``-rank trainer group (its merge function)."""
    from primitives.maths.metrics import merge_rank_updates

    cfg = TrainerConfig(zero_stage=2, lr=1e-3, micro_batch_size=3, max_grad_norm=1.0)
    actors = start_ranks(ray, TrainerWorker, [((ModelConfig(path), r, world, cfg, 0), {}) for r in range(world)])
    try:
        rendezvous(ray, actors)
        per_rank = ray.get([a.train_step.remote(batch, algo, 0.7) for a in actors], timeout=300)
    finally:
        done(ray, actors)
    return merge_rank_updates(per_rank)


def test_logged_metrics_do_not_depend_on_the_number_of_ranks(ray_local, tiny_model_path):
    """Invariant 6, with two PPO epochs of two mini-batches (the clip ratio moves), sampling
    temperature 0.7, a reference other than the policy and generator logprobs off the
    trainer's (the capped importance weight acts): 1, 2 and 3 ranks log the same numbers."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    rng = np.random.default_rng(0)
    rollouts = [r._replace(ref_logprobs=r.logprobs - 0.2, logprobs=r.logprobs + rng.normal(0, 0.3, r.num_tokens)
                           .astype(np.float32)) for r in rollouts]
    algo = grpo(kl_coef=0.05, clip_eps_low=0.005, clip_eps_high=0.005, ppo_epochs=2, mini_batches=2, is_cap=1.5)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    one, updates = _logged(ray_local, tiny_model_path, batch, algo, 1)
    assert one["policy/updates"] == 4.0
    assert updates[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and updates[0]["policy/clip_frac"] == 0.0
    assert max(u["policy/clip_frac"] for u in updates[1:]) > 0.1  # the later updates do clip
    assert 0 < one["mismatch/is_clipped_frac"] < 1 and one["mismatch/k3"] > 0.01  # the weight acts
    for world in (2, 3):
        many, many_updates = _logged(ray_local, tiny_model_path, batch, algo, world)
        for key in KEYS:
            # fp32 sums over other shard boundaries: a few ulp (grad_norm 3.67107 differed by 1.01e-6 once)
            assert many[key] == pytest.approx(one[key], rel=1e-6, abs=1e-6), (world, key, many[key], one[key])
        for u1, un in zip(updates, many_updates):
            assert un["policy/clip_frac"] == pytest.approx(u1["policy/clip_frac"], abs=1e-6)
            assert un["loss/policy"] == pytest.approx(u1["loss/policy"], abs=1e-6)
