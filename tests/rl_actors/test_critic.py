"""The PPO critic group on real DeepSpeed: its values are the one-process value model's; one
value step on 1 rank, 2 ranks (ZeRO-2) and 2 ranks (ZeRO-3) gives the one-process loss,
grad norm and updated values; several updates log the same metrics on 1 and 2 ranks; value
steps reduce the loss; save + load into a fresh group resumes exactly."""

import numpy as np
import pytest
import torch

from primitives.maths.algorithms import ppo
from primitives.maths.batching import make_batch
from primitives.maths.metrics import merge_rank_updates
from primitives.model.training import optim_step, step_counts
from primitives.model.value import (
    load_value_model,
    rollout_values,
    value_forward_backward,
    value_model_from_policy,
)
from primitives.types import ModelConfig
from rl_actors.critic import CriticWorker, concat_value_shares
from rl_actors.trainer import TrainerConfig
from tests.actors import done, rendezvous, start_ranks
from tests.conftest import scored_rollouts

LR = 1e-3
HEAD_STD = 0.05  # a random head, so initial values are not all zero


def _critic_group(ray, path, stage, world=2, fresh=False, bf16=False):
    # micro-batches of 3: several a step
    cfg = TrainerConfig(zero_stage=stage, lr=LR, micro_batch_size=3, max_grad_norm=1.0, bf16=bf16)
    actors = start_ranks(ray, CriticWorker, [((ModelConfig(path), r, world, cfg, 0), {"head_init_std": HEAD_STD})
                                             for r in range(world)], fresh=fresh)
    infos = rendezvous(ray, actors)
    assert [i["role"] for i in infos] == ["critic"] * world and infos[0]["zero_stage"] == stage
    return actors


def _group_values(ray, actors, rollouts):
    return concat_value_shares(ray.get([a.values_share.remote(rollouts) for a in actors], timeout=300))


def _batch(path, algo):
    """Rollouts, their values from the (random-head) value model, a PPO batch with those as
    old values, and the pad id."""
    rollouts, tok = scored_rollouts(path)
    values = rollout_values(value_model_from_policy(path, head_init_std=HEAD_STD, seed=0), rollouts, tok.pad_token_id)
    return rollouts, values, make_batch(rollouts, algo, tok.pad_token_id, values=values, budget=4), tok.pad_token_id


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _single_process(path, batch, rollouts, pad_id, clip):
    """One value update in this process: AdamW on the whole batch, micro-batches of 5."""
    model = value_model_from_policy(path, head_init_std=HEAD_STD, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    metrics = value_forward_backward(model, batch, step_counts(batch), clip, micro_batch_size=5)
    metrics["critic/grad_norm"] = optim_step(model, opt, max_grad_norm=1.0)
    return metrics, rollout_values(model, rollouts, pad_id)


def test_values_and_one_step_match_one_process_on_1_and_2_ranks(ray_local, tiny_model_path):
    """Before any step the group's values are the test process's value model's (shares of 2
    ranks joined in order); after one value step, 1 rank (ZeRO-2), 2 ranks (ZeRO-2) and
    2 ranks (ZeRO-3) all log the one-process loss and grad norm and hold its values."""
    algo = ppo(kl_coef=0.0, value_clip=0.05)  # small clip: some tokens take the clipped branch
    rollouts, values, batch, pad_id = _batch(tiny_model_path, algo)
    # old values 0.1 off the current ones, so the first update already clips: away from the
    # return on even rows (the clipped branch is taken), towards it on odd rows (it is not)
    away = np.where(np.arange(batch.size)[:, None] % 2 == 0, -1.0, 1.0).astype(np.float32)
    batch = batch._replace(values=batch.values + 0.1 * away * np.sign(batch.returns - batch.values)
                           * batch.loss_mask)
    ref, ref_values = _single_process(tiny_model_path, batch, rollouts, pad_id, algo.value_clip)
    assert ref["critic/grad_norm"] > 1.0  # clipping to 1.0 is exercised
    assert _max_diff(ref_values, values) > 1e-3  # the step moved the values
    for world, stage in ((1, 2), (2, 2), (2, 3)):
        actors = _critic_group(ray_local, tiny_model_path, stage, world)
        try:
            before = _group_values(ray_local, actors, rollouts)
            assert [len(v) for v in before] == [r.num_tokens for r in rollouts]
            assert _max_diff(before, values) < 1e-6, (world, stage)
            summary, updates = merge_rank_updates(ray_local.get([a.value_step.remote(batch, algo) for a in actors],
                                                                timeout=300))
            after = _group_values(ray_local, actors, rollouts)
            whole = ray_local.get([a.values.remote(rollouts) for a in actors], timeout=300)
            # 7 rollouts: shares of 4 and 3 take 2 and 1 micro-batches (ZeRO-3 pads with a forward)
            uneven = _group_values(ray_local, actors, rollouts[:7])
        finally:
            done(ray_local, actors)
        assert len(updates) == 1 and summary["critic/lr"] == LR
        for key in ("critic/value_loss", "critic/values_mean", "critic/clip_frac", "critic/returns_mean"):
            assert summary[key] == pytest.approx(ref[key], abs=1e-6), (world, stage, key)
        assert summary["critic/grad_norm"] == pytest.approx(ref["critic/grad_norm"], rel=1e-5), (world, stage)
        assert _max_diff(after, ref_values) < 1e-5, (world, stage, _max_diff(after, ref_values))
        for v in whole:  # every rank computes every value alike
            assert _max_diff(v, after) < 1e-6
        assert len(uneven) == 7 and _max_diff(uneven, after[:7]) < 1e-6
    assert 0.3 < ref["critic/clip_frac"] < 0.7


def test_one_bf16_critic_rank_steps_as_fp32_does(ray_local, tiny_model_path):
    """bf16 (what a GPU runs) on one critic rank runs ZeRO-1 (``engine_stage``): one value step logs the
    one-process fp32 loss and gradient norm to bf16's rounding of the forward (1 %), and moves the
    values as far as fp32 does, the gap a small part of the move (when written: loss and norm within
    0.06 %, values moved 3.675 against 3.683 on average, 0.0086 apart)."""
    algo = ppo(kl_coef=0.0)  # the clip (0.2) does not bind at a first step from the rollout-time values
    rollouts, values, batch, pad_id = _batch(tiny_model_path, algo)
    ref, ref_values = _single_process(tiny_model_path, batch, rollouts, pad_id, algo.value_clip)
    assert ref["critic/clip_frac"] == 0.0
    actors = _critic_group(ray_local, tiny_model_path, 2, world=1, bf16=True)
    try:
        info = ray_local.get(actors[0].info.remote())
        summary, _ = merge_rank_updates(ray_local.get([a.value_step.remote(batch, algo) for a in actors],
                                                      timeout=300))
        after = _group_values(ray_local, actors, rollouts)
    finally:
        done(ray_local, actors)
    assert (info["engine_stage"], info["bf16"]) == (1, True)
    assert summary["critic/value_loss"] == pytest.approx(ref["critic/value_loss"], rel=1e-2)
    moved = np.concatenate([r - v for r, v in zip(ref_values, values)])
    ours = np.concatenate([a - v for a, v in zip(after, values)])
    assert summary["critic/grad_norm"] == pytest.approx(ref["critic/grad_norm"], rel=1e-2)
    assert np.abs(ours).mean() == pytest.approx(np.abs(moved).mean(), rel=0.02)
    assert np.abs(ours - moved).mean() < 0.02 * np.abs(moved).mean()


def test_several_updates_log_the_same_on_1_and_2_ranks(ray_local, tiny_model_path):
    """Two PPO epochs of two mini-batches (the clip acts in later updates): per-update
    metrics of 2 ranks equal 1 rank's, and so do the values after the step."""
    algo = ppo(kl_coef=0.0, value_clip=0.02, ppo_epochs=2, mini_batches=2)
    rollouts, _, batch, _ = _batch(tiny_model_path, algo)
    runs = {}
    for world in (1, 2):
        actors = _critic_group(ray_local, tiny_model_path, 2, world)
        try:
            per_rank = ray_local.get([a.value_step.remote(batch, algo) for a in actors], timeout=300)
            runs[world] = merge_rank_updates(per_rank)[1], _group_values(ray_local, actors, rollouts)
        finally:
            done(ray_local, actors)
    (one, one_values), (two, two_values) = runs[1], runs[2]
    assert len(one) == len(two) == 4
    assert one[0]["critic/clip_frac"] == 0.0 and max(u["critic/clip_frac"] for u in one[1:]) > 0.05
    for u1, u2 in zip(one, two):
        for key in ("critic/value_loss", "critic/clip_frac", "critic/values_mean"):
            assert u2[key] == pytest.approx(u1[key], abs=5e-6), key
        assert u2["critic/grad_norm"] == pytest.approx(u1["critic/grad_norm"], rel=1e-5)
    assert _max_diff(two_values, one_values) < 1e-5


def test_value_steps_reduce_the_loss(ray_local, tiny_model_path):
    """Six steps on the same batch (fixed returns; a clip too wide to bind) at the lr passed
    to ``value_step``: the value loss falls every step, to under half its start."""
    algo = ppo(kl_coef=0.0, value_clip=100.0)
    batch = _batch(tiny_model_path, algo)[2]
    actors = _critic_group(ray_local, tiny_model_path, 2, world=1)
    try:
        updates = [ray_local.get(actors[0].value_step.remote(batch, algo, lr=2e-5), timeout=300)[0]
                   for _ in range(6)]
    finally:
        done(ray_local, actors)
    losses = [u["critic/value_loss"] for u in updates]
    assert all(u["critic/lr"] == 2e-5 for u in updates)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("stage", [2, 3])
def test_save_then_load_resumes_exactly(ray_local, tiny_model_path, tmp_path, stage):
    """A 2-rank group steps, saves and steps again; a fresh group loads the checkpoint and
    steps: the same values after loading, the same metrics and values after the next step
    (optimizer moments restored); the HF copy loads in one process with the same values."""
    algo = ppo(kl_coef=0.0, value_clip=0.05)
    rollouts, _, batch, pad_id = _batch(tiny_model_path, algo)
    path = str(tmp_path / "critic")
    actors = _critic_group(ray_local, tiny_model_path, stage)
    try:
        ray_local.get([a.value_step.remote(batch, algo) for a in actors], timeout=300)
        ray_local.get([a.save_checkpoint.remote(path) for a in actors], timeout=300)
        saved = _group_values(ray_local, actors, rollouts)
        cont = merge_rank_updates(ray_local.get([a.value_step.remote(batch, algo) for a in actors], timeout=300))[1]
        cont_values = _group_values(ray_local, actors, rollouts)
    finally:
        done(ray_local, actors)
    fresh = _critic_group(ray_local, tiny_model_path, stage, fresh=True)  # new processes
    try:
        meta = ray_local.get([a.load_checkpoint.remote(path) for a in fresh], timeout=300)
        loaded = _group_values(ray_local, fresh, rollouts)
        resumed = merge_rank_updates(ray_local.get([a.value_step.remote(batch, algo) for a in fresh], timeout=300))[1]
        resumed_values = _group_values(ray_local, fresh, rollouts)
    finally:
        done(ray_local, fresh)
    assert meta[0] == {"steps": 1, "init": "policy"}
    assert _max_diff(loaded, saved) == 0.0
    assert resumed == cont
    assert _max_diff(resumed_values, cont_values) == 0.0
    hf_values = rollout_values(load_value_model(f"{path}/hf"), rollouts, pad_id)
    assert _max_diff(hf_values, saved) < 1e-6


def test_bad_batches_are_refused_before_any_collective(ray_local, tiny_model_path):
    """Checked before the engine is touched (no setup needed): a batch without values or
    returns, and a critic initialised from something that is not a directory. (Uneven shards
    are not refused: every rank pads to the same passes, tests/rl_actors/test_uneven_shards.py.)"""
    algo = ppo(kl_coef=0.0)
    batch = _batch(tiny_model_path, algo)[2]
    actor, = start_ranks(ray_local, CriticWorker,
                         [((ModelConfig(tiny_model_path), 0, 2, TrainerConfig(zero_stage=3, micro_batch_size=3)), {})])
    try:
        with pytest.raises(ValueError, match="needs batch.values and batch.returns"):
            ray_local.get(actor.value_step.remote(batch._replace(returns=None), algo), timeout=120)
    finally:
        done(ray_local, [actor])
    with pytest.raises(FileNotFoundError, match="init must be 'policy' or a reward model directory"):
        CriticWorker(ModelConfig(tiny_model_path), 0, 1, init="/no/such/reward_model")
