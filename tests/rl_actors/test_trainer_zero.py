"""Invariant 2 on real DeepSpeed: ZeRO-1, 2 and 3 over 2 ranks give the single-process loss
and the single-process updated weights for the same batch."""

import os

import numpy as np
import pytest
import torch

from primitives.maths.algorithms import dapo, grpo
from primitives.maths.batching import make_batch
from primitives.model import tied_gradient
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


@pytest.mark.no_ray
def test_the_stage_deepspeed_runs():
    """One rank partitions nothing: fp32 drops ZeRO-1/2 for stage 0, bf16 (which stage 0 would accumulate
    in bf16) runs ZeRO-2 as ZeRO-1, the same optimizer without gradient buckets. ZeRO-3 and larger
    groups run what was configured; a stage outside 1-3 is refused by name."""
    from rl_actors.deepspeed_rank import engine_stage

    got = {(stage, world, bf16): engine_stage(stage, world, bf16)
           for stage in (1, 2, 3) for world in (1, 2, 3) for bf16 in (False, True)}
    want = {(stage, world, bf16): stage for stage, world, bf16 in got}
    want.update({(1, 1, False): 0, (2, 1, False): 0, (1, 1, True): 1, (2, 1, True): 1})
    assert got == want
    with pytest.raises(ValueError, match="zero_stage must be 1, 2 or 3, got 0"):
        engine_stage(0, 1, True)


def _single_process(path, batch, algo):
    """One update in this process, the tied embedding's gradient made as PyTorch makes it: the trainers'
    (folded, ``primitives.model.tied_gradient``) are checked against it under DeepSpeed's hooks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    with tied_gradient.folding(False):
        metrics = forward_backward(model, batch, algo, step_counts(batch), micro_batch_size=5)
    grad_norm = optim_step(model, opt, max_grad_norm=1.0)
    return metrics["loss/policy"], grad_norm, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _compare_weights(got, expected, what):
    """Every weight within 2 % of lr of the one-process weight (see ``EPS``), and the mean
    difference far smaller."""
    diffs = np.concatenate([np.abs(got[n] - w).ravel() for n, w in expected.items()])
    assert diffs.max() < 0.02 * LR, f"{what}: weights differ by up to {diffs.max()}"
    assert diffs.mean() < 1e-3 * LR, f"{what}: mean weight difference {diffs.mean()}"


def _trainer_group(ray, path, stage, world=2, bf16=False, checkpointing=False):
    # micro-batches of 3: several per rank
    cfg = TrainerConfig(zero_stage=stage, lr=LR, micro_batch_size=3, max_grad_norm=1.0, adam_eps=EPS, bf16=bf16,
                        gradient_checkpointing=checkpointing)
    actors = start_ranks(ray, TrainerWorker, [((ModelConfig(path), r, world, cfg, 0), {}) for r in range(world)])
    rendezvous(ray, actors)
    return actors


@pytest.mark.parametrize("stage,world,checkpointing", [(1, 2, False), (2, 2, False), (3, 2, False), (1, 1, False),
                                                      (2, 1, False), (3, 2, True), (2, 2, True)])
def test_zero_stage_matches_single_process(ray_local, tiny_model_path, stage, world, checkpointing):
    """Over 2 ranks, and on one rank, where ZeRO-1/2 run as DeepSpeed's stage 0 (the rank clips); and ZeRO-3
    with gradient checkpointing (each layer's partitioned weights gathered again for its recompute), ZeRO-2 with
    it too. ZeRO-1/2 ranks fold the tied embedding's gradient, this process does not: the same update."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    algo = dapo(overlong_buffer_frac=0.5)  # token-mean + clip-higher
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    batch = batch._replace(old_logprobs=batch.behaviour_logprobs - 0.05 * batch.loss_mask)  # ratios != 1
    ref_loss, ref_norm, ref_weights = _single_process(tiny_model_path, batch, algo)

    actors = _trainer_group(ray_local, tiny_model_path, stage, world, checkpointing=checkpointing)
    try:
        info = ray_local.get(actors[0].info.remote())
        stats = [u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
        states = ray_local.get([a.full_state.remote() for a in actors], timeout=300)
    finally:
        done(ray_local, actors)
    sharded_loss = sum(s["loss/policy"] for s in stats)  # each rank's share of the global loss
    assert sharded_loss == pytest.approx(ref_loss, abs=1e-6)
    assert stats[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # the reduced gradient is the global one
    assert ref_norm > 1.0  # so clipping to 1.0 was exercised too
    assert info["engine_stage"] == (0 if world == 1 else stage)
    assert info["model"]["gradient_checkpointing"] is checkpointing
    assert info["folds_tied_gradient"] is (stage != 3)  # the tiny model's head is tied: ZeRO-1/2 fold it
    _compare_weights(states[0], ref_weights, f"ZeRO-{stage} over {world}")
    for n in ref_weights:  # every rank holds the same model after the step
        assert all(np.array_equal(states[0][n], s[n]) for s in states[1:])
    moved = max(float(np.abs(states[0][n] - w).max()) for n, w in
                _initial(tiny_model_path).items())
    assert moved > 1e-4  # the step really changed the weights


def test_zero3_checkpointed_rank_without_rows_at_its_first_update(ray_local, tiny_model_path):
    """ZeRO-3 over 2 ranks with gradient checkpointing, a first update (SFT) of one row: rank 1 has none and
    makes a padding pass. A model loads in eval mode, where checkpointed layers recompute nothing, so that
    rank's backward gathered each layer's weights once where rank 0's gathered them again for its recompute,
    and gloo refused the mismatched collectives. Every pass now runs in train mode: both ranks step, with
    the one-process gradient norm."""
    from transformers import AutoModelForCausalLM

    from primitives.model.training import sft_forward_backward

    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    ones = np.ones_like(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    sft_forward_backward(model, ids, ones, ones, int(ones[:, 1:].sum()), None)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    actors = _trainer_group(ray_local, tiny_model_path, 3, world=2, checkpointing=True)
    try:
        stats = ray_local.get([a.sft_step.remote(ids, ones, ones) for a in actors], timeout=300)
    finally:
        done(ray_local, actors)
    assert [s["grad_norm"] for s in stats] == pytest.approx([norm, norm], rel=1e-5)


def _initial(path):
    from transformers import AutoModelForCausalLM

    return {n: p.detach().numpy() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


@pytest.mark.parametrize("stage,checkpointing", [(2, False), (3, True)])
def test_grpo_with_kl_and_three_ranks(ray_local, tiny_model_path, stage, checkpointing):
    """Uneven shards (16 rows over 3 ranks) with KL in the loss: still the global loss; and so under
    ZeRO-3 with gradient checkpointing, where each rank gathers every layer's partitioned weights once
    more for its recompute, whatever its share of the rows."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    rollouts = [r._replace(ref_logprobs=r.logprobs - 0.1) for r in rollouts]
    algo = grpo(kl_coef=0.05)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    ref_loss, ref_norm, ref_weights = _single_process(tiny_model_path, batch, algo)
    actors = _trainer_group(ray_local, tiny_model_path, stage, world=3, checkpointing=checkpointing)
    try:
        info = ray_local.get(actors[0].info.remote())
        stats = [u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
        state = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
    finally:
        done(ray_local, actors)
    assert (info["engine_stage"], info["model"]["gradient_checkpointing"]) == (stage, checkpointing)
    assert sum(s["loss/policy"] for s in stats) == pytest.approx(ref_loss, abs=1e-6)
    assert sum(s["loss/kl"] for s in stats) > 0
    assert stats[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    _compare_weights(state, ref_weights, f"ZeRO-{stage} over 3 ranks")


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


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_rank_checkpoints_and_restores_exactly(ray_local, tiny_model_path, tmp_path, bf16):
    """A 1-rank ZeRO-2 group (fp32: DeepSpeed stage 0, one optimizer state, no shards; bf16: ZeRO-1, one
    shard): step 1, checkpoint and snapshot, step 2. A group loaded from the checkpoint and a new one
    restored from the snapshot make step 2 bit for bit (weights, Adam moments, step count). A 2-rank
    group refuses the checkpoint by name before DeepSpeed reads it (it holds one rank's files)."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    algo = grpo(kl_coef=0.0)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    path = str(tmp_path / "ckpt")
    step = lambda actors: ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)  # noqa: E731
    actors = _trainer_group(ray_local, tiny_model_path, 2, world=1, bf16=bf16)
    try:
        assert ray_local.get(actors[0].info.remote())["engine_stage"] == (1 if bf16 else 0)
        step(actors)
        ray_local.get(actors[0].save_checkpoint.remote(path, {"iteration": 1}), timeout=300)
        part = ray_local.get(actors[0].snapshot.remote(), timeout=300)[1]
        second = step(actors)[0][0]
        continuous = ray_local.get(actors[0].full_state.remote())
    finally:
        done(ray_local, actors)
    assert second["grad_norm"] > 1.0  # clipped (fp32: by the rank's own clip)
    shard = ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"] if bf16 else []
    assert sorted(os.listdir(os.path.join(path, "deepspeed", "engine"))) == shard + ["mp_rank_00_model_states.pt"]
    for resume in ("load_checkpoint", "restore"):
        actors = _trainer_group(ray_local, tiny_model_path, 2, world=1, bf16=bf16)
        try:
            ray_local.get(getattr(actors[0], resume).remote(path if resume == "load_checkpoint" else part), timeout=300)
            again = step(actors)[0][0]
            resumed = ray_local.get(actors[0].full_state.remote())
        finally:
            done(ray_local, actors)
        assert again["grad_norm"] == second["grad_norm"] and again["loss/policy"] == second["loss/policy"], resume
        for name, value in continuous.items():
            assert np.array_equal(resumed[name], value), (resume, name)
    actors = _trainer_group(ray_local, tiny_model_path, 2, world=2, bf16=bf16)
    wrote = "1 ZeRO optimizer shard\\(s\\)" if bf16 else "one optimizer state, no ZeRO shards \\(one rank\\)"
    try:
        with pytest.raises(ray_local.exceptions.RayTaskError,
                           match=rf"trainer [01]: .*ckpt holds {wrote}; this group of 2 rank\(s\) under zero_stage 2 "
                                 r"runs ZeRO-2"):
            ray_local.get([a.load_checkpoint.remote(path) for a in actors], timeout=300)
    finally:
        done(ray_local, actors)


def test_one_rank_bf16_updates_as_fp32_does(ray_local, tiny_model_path):
    """bf16 (what a GPU runs) on one rank and on two, on CPU: ZeRO stays on (``engine_stage``: ZeRO-1 on
    one rank, ZeRO-2 on two), and the first update lands where fp32's does, to bf16's rounding of the
    weights. DeepSpeed's stage 0 in bf16 (gradients accumulated in bf16) moved the weights 0.71 lr on
    average where fp32 moves them 0.97 lr, and landed 2.6e-4 from fp32's weights on average; ZeRO-2
    landed 3.3e-5 away (measured when one rank still ran ZeRO-2; the bounds below hold for ZeRO-1)."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    algo = grpo(kl_coef=0.0)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    start = _initial(tiny_model_path)
    _, fp32_norm, fp32 = _single_process(tiny_model_path, batch, algo)
    fp32_moved = np.concatenate([(fp32[n] - start[n]).ravel() for n in start])
    for world in (1, 2):
        cfg = TrainerConfig(zero_stage=2, lr=LR, micro_batch_size=3, max_grad_norm=1.0, adam_eps=EPS, bf16=True)
        actors = start_ranks(ray_local, TrainerWorker, [((ModelConfig(tiny_model_path), r, world, cfg, 0), {})
                                                        for r in range(world)])
        try:
            info = rendezvous(ray_local, actors)[0]
            stats = [u[0] for u in ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)]
            weights = ray_local.get([a.full_state.remote() for a in actors], timeout=300)[0]
        finally:
            done(ray_local, actors)
        assert (info["engine_stage"], info["bf16"]) == (1 if world == 1 else 2, True)
        assert stats[0]["grad_norm"] == pytest.approx(fp32_norm, rel=1e-3)
        moved = np.concatenate([(weights[n] - start[n]).ravel() for n in start])
        assert np.abs(moved).mean() == pytest.approx(np.abs(fp32_moved).mean(), rel=0.05), world
        assert np.abs(moved - fp32_moved).mean() < 1e-4, world


@pytest.mark.parametrize("world", [1, 2])
def test_a_non_finite_gradient_updates_nothing(ray_local, tiny_model_path, world):
    """A NaN in the loss (here an advantage): ZeRO-2 over 2 ranks skips the update, and so does one
    rank without ZeRO (its own clip sees the NaN norm): weights unchanged, the norm logged as it is,
    and the next step trains from the untouched weights and Adam state as a first step would."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    algo = grpo(kl_coef=0.0)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4)
    poisoned = batch._replace(advantages=batch.advantages.copy())
    poisoned.advantages[0] = np.nan
    actors = _trainer_group(ray_local, tiny_model_path, 2, world)
    try:
        before = ray_local.get(actors[0].full_state.remote())
        bad = ray_local.get([a.train_step.remote(poisoned, algo, 1.0) for a in actors], timeout=300)[0][0]
        after_bad = ray_local.get(actors[0].full_state.remote())
        good = ray_local.get([a.train_step.remote(batch, algo, 1.0) for a in actors], timeout=300)
        after_good = ray_local.get(actors[0].full_state.remote())
    finally:
        done(ray_local, actors)
    assert not np.isfinite(bad["grad_norm"])
    for name, value in before.items():
        assert np.array_equal(after_bad[name], value), name
    ref_loss, ref_norm, ref_weights = _single_process(tiny_model_path, batch, algo)
    assert sum(u[0]["loss/policy"] for u in good) == pytest.approx(ref_loss, abs=1e-6)
    assert good[0][0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    _compare_weights(after_good, ref_weights, f"after a skipped update, {world} rank(s)")
