"""Invariant 9 on real DeepSpeed: rows that do not split evenly over the ranks (9 rows on
2 ranks in micro-batches of 4: shards of 4 and 5, one micro-batch against two) give the
one-process result under ZeRO-1, 2 and 3, for the RL step with an old-logprob pass
(2 PPO epochs), the SFT step, the held-out SFT loss and the critic's values and value step;
online-DPO pairs stay whole when 3 pairs meet 2 ranks. Before every rank made the largest
shard's number of passes, ZeRO-2 aborted (gloo: collective mismatch) and ZeRO-3 hung."""

import numpy as np
import pytest
import torch

from primitives.maths.algorithms import grpo, online_dpo, ppo
from primitives.maths.batching import make_batch
from primitives.maths.metrics import merge_rank_updates
from primitives.model.training import optim_step, sft_eval_loss, sft_forward_backward, step_counts, train_on_batch
from primitives.model.value import rollout_values, value_forward_backward, value_model_from_policy
from primitives.types import ModelConfig
from rl_actors.critic import CriticWorker, concat_value_shares
from rl_actors.deepspeed_rank import largest_shard, passes
from rl_actors.trainer import TrainerConfig, TrainerWorker
from tests.actors import done, rendezvous, start_ranks
from tests.conftest import scored_rollouts

LR = 1e-3
# Adam's epsilon on both sides: at torch's 1e-8 a weight whose gradient is near zero turns the ranks' other summation
# order into a step of another size (3.1e-5 apart on an AVX-512 machine, under 2e-5 on an AVX2 one)
EPS = 1e-6
MICRO = 4
ROWS = 9
TEMPERATURE = 0.7
HEAD_STD = 0.05


def test_passes_are_the_largest_shards_count():
    """Hand-worked: 9 rows on 2 ranks are shards of 4 and 5; in micro-batches of 4 that is 1
    and 2 passes, so both make 2. 6 rows as 3 pairs on 2 ranks are 2 and 4 rows; micro-batches
    of 3 become 4 to keep pairs whole: 1 pass each. 7 rows on 3 ranks: 2, 2, 3."""
    assert largest_shard(9, 2) == 5 and passes(9, 2, 4) == 2
    assert largest_shard(8, 2) == 4 and passes(8, 2, 4) == 1
    assert largest_shard(6, 2, unit=2) == 4 and passes(6, 2, 3, unit=2) == 1
    assert largest_shard(7, 3) == 3 and passes(7, 3, 2) == 2
    assert largest_shard(1, 3) == 1 and passes(1, 3, 4) == 1
    assert passes(0, 2, 4) == 0


def _group(ray, cls, path, stage, world=2, **kwargs):
    cfg = TrainerConfig(zero_stage=stage, lr=LR, micro_batch_size=MICRO, max_grad_norm=1.0, adam_eps=EPS)
    actors = start_ranks(ray, cls, [((ModelConfig(path), r, world, cfg, 0), kwargs) for r in range(world)])
    rendezvous(ray, actors)
    return actors


def _all(ray, actors, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in actors], timeout=300)


def _max_diff(got: dict, expected: dict) -> float:
    return max(float(np.abs(got[n] - w).max()) for n, w in expected.items())


def _sft_rows(tok, rows=ROWS):
    """``rows`` right-padded SFT samples of different lengths, loss on all but the first token."""
    texts = [f"{i}+{i + 3}={2 * i + 3}" + "9" * (i % 4) for i in range(rows)]
    ids = [tok(t)["input_ids"] for t in texts]
    L = max(len(x) for x in ids)
    input_ids = np.full((rows, L), tok.pad_token_id, dtype=np.int64)
    attention = np.zeros((rows, L), dtype=np.int64)
    for i, x in enumerate(ids):
        input_ids[i, :len(x)], attention[i, :len(x)] = x, 1
    loss_mask = attention.copy()
    loss_mask[:, 0] = 0
    return input_ids, attention, loss_mask


def _rl_batch(path):
    """A 9-row GRPO batch (2 PPO epochs: the old logprobs are fixed by a forward pass) whose
    generator logprobs sit off the trainer's, so the capped importance weight acts."""
    rollouts, tok = scored_rollouts(path)
    rng = np.random.default_rng(0)
    rollouts = [r._replace(ref_logprobs=r.logprobs - 0.2,
                           logprobs=r.logprobs + rng.normal(0, 0.3, r.num_tokens).astype(np.float32))
                for r in rollouts]
    algo = grpo(kl_coef=0.05, clip_eps_low=0.01, clip_eps_high=0.01, ppo_epochs=2, is_cap=1.5)
    return make_batch(rollouts, algo, tok.pad_token_id, budget=4).select(range(ROWS)), algo, tok


def _one_process(path, batch, algo, sft):
    """The RL step, then the SFT step and the held-out SFT loss, in this process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    rl = train_on_batch(model, opt, batch, algo, TEMPERATURE, max_grad_norm=1.0, micro_batch_size=MICRO)
    if sft is None:
        return rl, None, None, None
    input_ids, attention, loss_mask = sft
    num_tokens = int(loss_mask[:, 1:].sum())
    sft_metrics = sft_forward_backward(model, input_ids, attention, loss_mask, num_tokens, MICRO)
    sft_metrics["grad_norm"] = optim_step(model, opt, max_grad_norm=1.0)
    held_out = sft_eval_loss(model, input_ids, attention, loss_mask, num_tokens, MICRO)
    return rl, sft_metrics, held_out, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nine_rows_on_two_ranks_equal_one_process(ray_local, tiny_model_path, stage):
    """The RL step (2 epochs: the old-logprob pass, then 2 updates), the SFT step and the
    held-out SFT loss on 9 rows over 2 ranks log the one-process numbers and leave its weights."""
    batch, algo, tok = _rl_batch(tiny_model_path)
    sft = _sft_rows(tok)
    rl_ref, sft_ref, eval_ref, weights_ref = _one_process(tiny_model_path, batch, algo, sft)
    actors = _group(ray_local, TrainerWorker, tiny_model_path, stage)
    try:
        summary, updates = merge_rank_updates(_all(ray_local, actors, "train_step", batch, algo, TEMPERATURE))
        sft_got = _all(ray_local, actors, "sft_step", *sft)
        eval_got = _all(ray_local, actors, "sft_eval", *sft)
        states = _all(ray_local, actors, "full_state")
    finally:
        done(ray_local, actors)
    assert len(updates) == len(rl_ref) == 2
    for got, expected in zip(updates, rl_ref):
        for key in ("loss/policy", "loss/kl", "policy/clip_frac", "policy/ratio_mean", "mismatch/is_weight_mean"):
            assert got[key] == pytest.approx(expected[key], abs=2e-6), (stage, key)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), stage
    assert updates[1]["policy/clip_frac"] > 0  # the second update's ratio is against the fixed old logprobs
    assert sum(s["loss/sft"] for s in sft_got) == pytest.approx(sft_ref["loss/sft"], abs=2e-6)
    assert sft_got[0]["grad_norm"] == pytest.approx(sft_ref["grad_norm"], rel=1e-5)
    assert sum(e["eval/loss_sft"] for e in eval_got) == pytest.approx(eval_ref["eval/loss_sft"], abs=2e-6)
    assert _max_diff(states[0], weights_ref) < 2e-5, (stage, _max_diff(states[0], weights_ref))
    assert _max_diff(states[1], states[0]) == 0.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_critic_on_nine_rows_equals_one_process(ray_local, tiny_model_path, stage):
    """The critic's values of 9 rollouts (shares of 5 and 4) and one value step on 9 rows give
    the one-process values, loss, grad norm and updated values."""
    rollouts, tok = scored_rollouts(tiny_model_path)
    rollouts = rollouts[:ROWS]
    algo = ppo(kl_coef=0.0, value_clip=0.05)
    model = value_model_from_policy(tiny_model_path, head_init_std=HEAD_STD, seed=0)
    values = rollout_values(model, rollouts, tok.pad_token_id)
    batch = make_batch(rollouts, algo, tok.pad_token_id, values=values, budget=4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    ref = value_forward_backward(model, batch, step_counts(batch), algo.value_clip, micro_batch_size=MICRO)
    ref["critic/grad_norm"] = optim_step(model, opt, max_grad_norm=1.0)
    ref_after = rollout_values(model, rollouts, tok.pad_token_id)
    actors = _group(ray_local, CriticWorker, tiny_model_path, stage, head_init_std=HEAD_STD)
    try:
        before = concat_value_shares(_all(ray_local, actors, "values_share", rollouts))
        summary, _ = merge_rank_updates(_all(ray_local, actors, "value_step", batch, algo))
        after = concat_value_shares(_all(ray_local, actors, "values_share", rollouts))
    finally:
        done(ray_local, actors)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, values)) < 1e-6
    for key in ("critic/value_loss", "critic/values_mean", "critic/clip_frac"):
        assert summary[key] == pytest.approx(ref[key], abs=1e-6), (stage, key)
    assert summary["critic/grad_norm"] == pytest.approx(ref["critic/grad_norm"], rel=1e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(after, ref_after)) < 1e-5


def test_three_online_dpo_pairs_on_two_ranks_stay_whole(ray_local, tiny_model_path):
    """3 (chosen, rejected) pairs on 2 ranks (ZeRO-2): shards of 1 and 2 pairs, never a pair
    split; the loss, the reward margin and the weights are the one process's."""
    from transformers import AutoModelForCausalLM

    rollouts, tok = scored_rollouts(tiny_model_path)
    rng = np.random.default_rng(1)
    rollouts = [r._replace(ref_logprobs=r.logprobs + rng.normal(0, 0.2, r.num_tokens).astype(np.float32))
                for r in rollouts]
    algo = online_dpo(beta=0.5)
    batch = make_batch(rollouts, algo, tok.pad_token_id, budget=4).select(range(6))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    ref = train_on_batch(model, opt, batch, algo, 1.0, max_grad_norm=1.0, micro_batch_size=3)[0]
    weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    cfg = TrainerConfig(zero_stage=2, lr=LR, micro_batch_size=3, max_grad_norm=1.0, adam_eps=EPS)
    actors = start_ranks(ray_local, TrainerWorker,
                         [((ModelConfig(tiny_model_path), r, 2, cfg, 0), {}) for r in range(2)])
    try:
        rendezvous(ray_local, actors)
        got = merge_rank_updates(_all(ray_local, actors, "train_step", batch, algo, 1.0))[1][0]
        state = _all(ray_local, actors, "full_state")[0]
    finally:
        done(ray_local, actors)
    for key in [k for k in ref if k.startswith(("loss/", "dpo/"))]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert _max_diff(state, weights) < 2e-5


def test_a_zero3_rank_without_rows_pads_its_passes(ray_local, tiny_model_path):
    """2 rows on 3 ZeRO-3 ranks with 2 PPO epochs: one rank has no rows, yet joins every
    parameter gather (old-logprob forward and both updates) with padding passes; the result is
    the one process's."""
    batch, algo, _ = _rl_batch(tiny_model_path)
    batch = batch.select(range(2))
    rl_ref = _one_process(tiny_model_path, batch, algo, None)[0]
    actors = _group(ray_local, TrainerWorker, tiny_model_path, 3, world=3)
    try:
        updates = merge_rank_updates(_all(ray_local, actors, "train_step", batch, algo, TEMPERATURE))[1]
    finally:
        done(ray_local, actors)
    assert len(updates) == len(rl_ref) == 2
    for got, expected in zip(updates, rl_ref):
        assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=2e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
