"""The learning signal, wired end to end and checked against hand-worked values.

Each test here would have caught one wiring mistake a review found: metrics merged
over ranks, the clip ratio against the generator's logprobs, the capped importance weight,
several updates per batch, returns across tool spans, Dr.GRPO's constant, KL in the reward,
overlong filtering, dropout, the temperature, the SFT mask shift and more. Inputs keep
padding, a temperature other than 1 and a reference other than the policy where it matters.
The "model" of several tests is ``TableModel``: next-token logits are a learnable table
indexed by the current token, so every logprob and gradient is computable by hand.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from primitives.maths import algorithms as algos
from primitives.maths.advantages import discounted_returns, gae_advantages
from primitives.maths.batching import collate, make_batch
from primitives.maths.losses import LossCounts, aggregate_loss, gspo_loss, truncated_is_weights
from primitives.maths.metrics import mean_over_updates, merge_metrics, merge_rank_updates, reduction
from primitives.maths.objectives import LossInputs, online_dpo_objective, policy_objective
from primitives.model.training import forward_backward, sft_forward_backward, step_counts, train_on_batch
from primitives.types import Rollout


class TableModel(torch.nn.Module):
    """``logits[b, t] = table[input_ids[b, t]]``: a bigram model with hand-computable logprobs."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **_):
        return SimpleNamespace(logits=self.table[input_ids])


def log_softmax(row, T=1.0):
    z = [x / T for x in row]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def rollout(uid, group, prompt, completion, logprobs, reward=0.0, finish="stop", mask=None, ref=None):
    n = len(completion)
    return Rollout(uid=uid, group=group, prompt="p", prompt_ids=np.asarray(prompt, dtype=np.int64),
                   completion_ids=np.asarray(completion, dtype=np.int64),
                   loss_mask=np.asarray(mask if mask is not None else [1.0] * n, dtype=np.float32),
                   logprobs=np.asarray(logprobs, dtype=np.float32), finish_reason=finish, reward=reward,
                   ref_logprobs=None if ref is None else np.asarray(ref, dtype=np.float32))


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ----------------------------------------------------------------------------- merging metrics

def test_merge_adds_shares_takes_maxima_and_keeps_global_values():
    rank0 = {"loss/policy": 0.25, "policy/clip_frac": 0.1, "mismatch/max_abs_logp_diff": 0.7, "grad_norm": 2.0}
    rank1 = {"loss/policy": 0.5, "policy/clip_frac": 0.05, "mismatch/max_abs_logp_diff": 0.3, "grad_norm": 2.0}
    merged = merge_metrics([rank0, rank1])
    assert merged == {"loss/policy": 0.75, "policy/clip_frac": pytest.approx(0.15), "mismatch/max_abs_logp_diff": 0.7,
                      "grad_norm": 2.0}
    assert [reduction(k) for k in ("reward/max", "reward/min", "response/len_max", "lr", "kl/ref_k3")] == \
        ["max", "min", "max", "first", "sum"]


def test_two_critic_ranks_log_the_critic_learning_rate_and_grad_norm_once():
    """Every critic rank holds the reduced grad norm and its lr whole (like the policy's):
    two ranks' updates merge to the one value, not twice it, while the value loss adds."""
    rank = {"critic/value_loss": 0.5, "critic/grad_norm": 1.5, "critic/lr": 3e-4}
    summary, _ = merge_rank_updates([[rank], [dict(rank, **{"critic/value_loss": 0.25})]])
    assert summary == {"critic/value_loss": 0.75, "critic/grad_norm": 1.5, "critic/lr": 3e-4, "policy/updates": 1.0}


def test_updates_are_averaged_after_ranks_are_merged():
    # two ranks, two updates: shares add within an update, updates average
    per_rank = [[{"loss/policy": 1.0, "policy/clip_frac": 0.0, "grad_norm": 3.0},
                 {"loss/policy": 2.0, "policy/clip_frac": 0.2, "grad_norm": 5.0}],
                [{"loss/policy": 3.0, "policy/clip_frac": 0.0, "grad_norm": 3.0},
                 {"loss/policy": 4.0, "policy/clip_frac": 0.4, "grad_norm": 5.0}]]
    summary, updates = merge_rank_updates(per_rank)
    assert updates == [{"loss/policy": 4.0, "policy/clip_frac": 0.0, "grad_norm": 3.0},
                       {"loss/policy": 6.0, "policy/clip_frac": pytest.approx(0.6), "grad_norm": 5.0}]
    assert summary == {"loss/policy": 5.0, "policy/clip_frac": pytest.approx(0.3), "grad_norm": 4.0,
                       "policy/updates": 2.0}
    assert mean_over_updates([{"x/max_a": 1.0}, {"x/max_a": 3.0}])["x/max_a"] == 3.0
    with pytest.raises(ValueError, match="different numbers of optimizer updates"):
        merge_rank_updates([[{}], [{}, {}]])


# ----------------------------------------------------------------------------- behaviour vs trained policy

def _is_inputs(level):
    logp = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    behaviour = t([[-0.7, -3.0, 4.5]])  # pad position holds garbage: it must not count
    return logp, LossInputs(logp=logp, old_logp=None, advantages=t([[1.0, 1.0, 0.0]]), mask=t([[1.0, 1.0, 0.0]]),
                            counts=LossCounts(2, 1), behaviour_logp=behaviour)


def test_truncated_is_weights_token_and_sequence():
    w, capped = truncated_is_weights(t([[-1.0, -2.0, -0.5]]), t([[-0.7, -3.0, 4.5]]), t([[1.0, 1.0, 0.0]]),
                                     "token", 2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(-0.3), 2.0, 0.0], abs=1e-6)  # e^1 = 2.718 capped at 2
    assert capped.tolist() == [[False, True, False]]
    w, capped = truncated_is_weights(t([[-1.0, -2.0, -0.5]]), t([[-0.7, -3.0, 4.5]]), t([[1.0, 1.0, 0.0]]),
                                     "sequence", 3.0)
    assert w.tolist()[0] == pytest.approx([math.exp(0.7), math.exp(0.7), 0.0], abs=1e-6)  # e^(-0.3 + 1.0)
    assert not capped.any()


def test_ratio_is_one_on_policy_and_the_capped_weight_corrects_the_generator():
    """The generator's logprobs are perturbed; the clip ratio stays 1 (old = trainer's own),
    and the loss is -A * min(pi_old / pi_gen, C), token-mean: (-(e^-0.3) - 2) / 2."""
    logp, x = _is_inputs("token")
    loss, m = policy_objective(x, algos.dapo(is_level="token", is_cap=2.0))  # token-mean
    loss = loss.squeeze()
    expected = -(math.exp(-0.3) + 2.0) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    assert m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-7) and m["policy/clip_frac"] == 0.0
    assert m["mismatch/is_weight_mean"] == pytest.approx(-expected, abs=1e-6)
    assert m["mismatch/is_clipped_frac"] == pytest.approx(0.5)
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(1.0, abs=1e-6)
    # k3 of KL(generator || trainer) on the generator's samples: e^d - 1 - d with d = old - gen
    k3 = [math.exp(d) - 1 - d for d in (-0.3, 1.0)]
    assert m["mismatch/k3"] == pytest.approx(sum(k3) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-math.exp(-0.3) / 2, -1.0, 0.0], abs=1e-6)
    # sequence level: one weight e^0.7 = 2.01 per row, capped at 2
    _, x = _is_inputs("sequence")
    loss, m = policy_objective(x, algos.dapo(is_level="sequence", is_cap=2.0))
    assert float(loss.detach()) == pytest.approx(-2.0, abs=1e-6) and m["mismatch/is_clipped_frac"] == 1.0
    # off: measured, not applied
    _, x = _is_inputs("off")
    loss, m = policy_objective(x, algos.dapo(is_level="off"))
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-6) and m["mismatch/is_clipped_frac"] == 0.5


def test_clip_uses_eps_low_below_and_eps_high_above():
    """eps_low 0.1, eps_high 0.3: ratio 1.25 (A>0) passes, 1.4 clips at 1.3; 0.85 (A<0)
    clips at 0.9, 0.95 passes. Swapping the two would change every value."""
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = torch.log(t([[1.25, 1.4, 0.85, 0.95]]))
    x = LossInputs(logp=logp, old_logp=old, advantages=t([[1.0, 1.0, -1.0, -1.0]]), mask=t([[1.0] * 4]),
                   counts=LossCounts(4, 1))
    loss, m = policy_objective(x, algos.dapo(clip_eps_low=0.1, clip_eps_high=0.3, is_level="off"))
    assert float(loss.detach()) == pytest.approx((-1.25 - 1.3 + 0.9 + 0.95) / 4, abs=1e-6)
    assert m["policy/clip_frac"] == pytest.approx(0.5)


def test_kl_in_the_loss_has_the_right_sign_and_value():
    """ref = logp - 0.5 everywhere: k3 = e^-0.5 - 1 + 0.5 per token; the loss adds +coef * k3
    and its gradient pushes logp toward the reference."""
    logp = t([[-1.0, -2.0, -3.0]]).requires_grad_(True)
    x = LossInputs(logp=logp, old_logp=None, advantages=t([[0.0, 0.0, 0.0]]), mask=t([[1.0, 1.0, 0.0]]),
                   counts=LossCounts(2, 1), ref_logp=logp.detach() - 0.5)
    loss, m = policy_objective(x, algos.grpo(kl_coef=0.1))
    k3 = math.exp(-0.5) - 1 + 0.5
    assert float(loss.detach()) == pytest.approx(0.1 * k3, abs=1e-7) and m["loss/kl"] == pytest.approx(k3, abs=1e-7)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.1 * (1 - math.exp(-0.5)) / 2] * 2 + [0.0], abs=1e-7)


def test_gspo_sequence_ratio_ignores_padding():
    logp, old = t([[0.1, 0.3, 5.0]]), t([[0.0, 0.0, 0.0]])
    loss, clipped = gspo_loss(logp, old, t([[1.0, 1.0, 1.0]]), t([[1.0, 1.0, 0.0]]), eps_low=0.3, eps_high=0.3)
    s = math.exp(0.2)  # mean of 0.1 and 0.3; the padded 5.0 is not in it
    assert loss.tolist()[0] == pytest.approx([-s, -s, 0.0], abs=1e-6) and not clipped.any()


def test_online_dpo_averages_over_pairs():
    """Two pairs with margins 2 and -1 (beta 0.5): loss = mean of -log sigmoid(0.5 m)."""
    x = LossInputs(logp=t([[-1.0], [-3.0], [-2.0], [-1.0]]), old_logp=None,
                   advantages=t([[1.0], [-1.0], [1.0], [-1.0]]), mask=t([[1.0]] * 4), counts=LossCounts(4, 4),
                   ref_logp=t([[-2.0], [-2.0], [-1.0], [-1.0]]))
    loss, m = online_dpo_objective(x, algos.online_dpo(beta=0.5))
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    assert m["dpo/margin"] == pytest.approx((1.0 - 0.5) / 2, abs=1e-6) and m["dpo/accuracy"] == 0.5


def test_online_dpo_never_pairs_a_truncated_completion():
    rs = [rollout("a", "g", [1], [1, 1], [0.0, 0.0], reward=1.0, finish="length"),
          rollout("b", "g", [1], [1], [0.0], reward=0.5), rollout("c", "g", [1], [1], [0.0], reward=0.0)]
    batch = make_batch(rs, algos.online_dpo(filter_overlong=True), pad_id=0)
    assert [r.uid for r in batch.rollouts] == ["b", "c"] and batch.loss_mask.sum(1).tolist() == [1.0, 1.0]


def test_online_dpo_orders_chosen_before_rejected():
    """Rows (chosen, rejected): pi sums -1 / -3, ref sums -2 / -2, margin 2, beta 0.1."""
    x = LossInputs(logp=t([[-0.5, -0.5], [-1.0, -2.0]]), old_logp=None, advantages=t([[1.0, 1.0], [-1.0, -1.0]]),
                   mask=t([[1.0, 1.0], [1.0, 1.0]]), counts=LossCounts(4, 2), ref_logp=t([[-1.0, -1.0], [-1.0, -1.0]]))
    loss, m = online_dpo_objective(x, algos.online_dpo(beta=0.1))
    assert float(loss.detach()) == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-6)  # -log sigmoid(0.2)
    assert m["dpo/margin"] == pytest.approx(0.2, abs=1e-6) and m["dpo/accuracy"] == 1.0


def test_aggregation_uses_its_mask():
    loss = t([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss, mask, "token-mean", LossCounts(3, 2))) == pytest.approx(2.0)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean", LossCounts(3, 2))) == pytest.approx(2.25)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", LossCounts(3, 2, max_len=4))) == \
        pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="generation budget"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", LossCounts(3, 2))


# ----------------------------------------------------------------------------- several updates per batch

def test_epochs_and_mini_batches_clip_as_hand_worked():
    """Two tokens (V=2), logits start at 0, SGD lr 1, seq-mean-token-mean, eps_low 0.5 / high 0.2.
    The generator's logprobs are off the trainer's (log 0.5) by d = (0.1, -0.2, 0.3), so each
    token's loss carries the capped weight w = e^-d (under the cap 2); the clip ratio does not.

    Mini-batch 1 = [a: token 0, A=+1]; mini-batch 2 = [b: token 0, A=+1], [c: token 1, A=-1].
    Update 1: ratio 1, gradient -w_a (e0 - p) = w_a (-0.5, 0.5), so theta = (0.5 w_a, -0.5 w_a).
    Update 2: p0 = sigmoid(w_a): ratio0 = 2 p0 > 1.2 (clipped, no gradient), ratio1 = 2 (1 - p0)
    > 0.5 (not clipped); loss (-1.2 w_b + w_c ratio1) / 2; theta_0 grows by 0.5 w_c ratio1 p0.
    Epoch 2 uses the old logprobs of before update 1 (log 0.5), so its ratios are far from 1."""
    model = TableModel([[0.0, 0.0], [0.0, 0.0]])
    half = math.log(0.5)
    d = (0.1, -0.2, 0.3)
    w_a, w_b, w_c = (math.exp(-x) for x in d)
    rs = [rollout("a", "g", [0], [0], [half + d[0]]), rollout("b", "g", [0], [0], [half + d[1]]),
          rollout("c", "g", [0], [1], [half + d[2]])]
    batch = collate(rs, np.array([[1.0], [1.0], [-1.0]], dtype=np.float32), pad_id=0, budget=1)
    algo = algos.grpo(kl_coef=0.0, clip_eps_low=0.5, clip_eps_high=0.2, ppo_epochs=2, mini_batches=2)
    updates = train_on_batch(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, algo, max_grad_norm=None)
    assert len(updates) == 4
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    # update 1: on policy, whatever the generator said
    assert updates[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-7) and updates[0]["policy/clip_frac"] == 0
    assert updates[0]["loss/policy"] == pytest.approx(-w_a, abs=1e-6)
    assert updates[0]["mismatch/is_weight_mean"] == pytest.approx(w_a, abs=1e-6)
    # update 2
    p0 = sig(w_a)
    r0, r1 = 2 * p0, 2 * (1 - p0)
    assert r0 > 1.2 and r1 > 0.5
    assert updates[1]["policy/clip_frac"] == pytest.approx(0.5)
    assert updates[1]["loss/policy"] == pytest.approx((-1.2 * w_b + w_c * r1) / 2, abs=1e-6)
    assert updates[1]["policy/ratio_mean"] == pytest.approx((r0 + r1) / 2, abs=1e-6)
    theta0 = 0.5 * w_a + 0.5 * w_c * r1 * p0
    # epoch 2, update 3: mini-batch 1 again, against log 0.5 (not the generator's logprob)
    p0 = sig(2 * theta0)
    assert updates[2]["policy/ratio_mean"] == pytest.approx(2 * p0, abs=1e-6)
    assert updates[2]["policy/clip_frac"] == 1.0 and updates[2]["loss/policy"] == pytest.approx(-1.2 * w_a, abs=1e-6)
    # update 4: ratio1 = 2 (1 - p0) < 0.5 with A < 0: clipped at 0.5
    assert 2 * (1 - p0) < 0.5
    assert updates[3]["policy/clip_frac"] == 1.0
    assert updates[3]["loss/policy"] == pytest.approx((-1.2 * w_b + 0.5 * w_c) / 2, abs=1e-6)
    assert model.table[0].tolist() == pytest.approx([theta0, -theta0], abs=1e-6)


def test_one_update_uses_the_trainers_logprobs_and_weights_the_generators():
    """The default path (one update, no old logprobs set): ratio 1 however far the generator's
    logprobs are; loss -A w with w = min(e^(trainer - generator), 2), token-mean."""
    table = [[0.0, 1.0, 2.0], [0.5, -1.0, 0.3], [1.0, 1.0, -2.0]]
    lp = [log_softmax(row) for row in table]
    d = [0.4, -0.3, -1.0, 0.2]  # generator minus trainer, per loss token
    rs = [rollout("a", "g", [0], [1, 2], [lp[0][1] + d[0], lp[1][2] + d[1]]),
          rollout("b", "g", [2], [0, 0], [lp[2][0] + d[2], lp[0][0] + d[3]])]
    batch = collate(rs, np.array([[1.0, 1.0], [-1.0, -1.0]], dtype=np.float32), pad_id=0, budget=2)
    model = TableModel(table)
    m = forward_backward(model, batch, algos.dapo(), step_counts(batch))  # token-mean, token-level IS, C = 2
    w = [min(math.exp(-x), 2.0) for x in d]  # e^1.0 = 2.72 is capped
    assert m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-7) and m["policy/clip_frac"] == 0.0
    assert m["loss/policy"] == pytest.approx((-w[0] - w[1] + w[2] + w[3]) / 4, abs=1e-6)
    assert m["mismatch/is_clipped_frac"] == pytest.approx(0.25)
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- temperature, SFT shift, dropout

def test_trainer_logprobs_use_the_temperature():
    """policy/entropy and kl/ref_k3 from forward_backward at T = 0.7, against a reference
    scored at T = 1 (so the KL is not 0): both computed by hand from the logit table."""
    table = [[0.0, 1.0, 2.0], [0.5, -1.0, 0.3], [1.0, 1.0, -2.0]]
    model = TableModel(table)
    rs = [rollout("a", "g", [0], [1, 2], [0.0, 0.0]), rollout("b", "g", [2], [0, 0], [0.0, 0.0])]
    lp = {T: [log_softmax(row, T) for row in table] for T in (0.7, 1.0)}
    rs = [r._replace(ref_logprobs=np.asarray([lp[1.0][prev][tok] for prev, tok in
                                              zip([r.prompt_ids[0]] + list(r.completion_ids[:-1]), r.completion_ids)],
                                             dtype=np.float32)) for r in rs]
    batch = collate(rs, np.zeros((2, 2), dtype=np.float32), pad_id=0, budget=2)
    m = forward_backward(model, batch, algos.grpo(kl_coef=0.0), step_counts(batch), temperature=0.7)
    contexts = [(0, 1), (1, 2), (2, 0), (0, 0)]  # (previous token, sampled token) of the 4 loss tokens
    entropy = [-sum(math.exp(x) * x for x in lp[0.7][prev]) for prev, _ in contexts]
    k3 = [math.exp(lp[1.0][p][s] - lp[0.7][p][s]) - 1 - (lp[1.0][p][s] - lp[0.7][p][s]) for p, s in contexts]
    assert m["policy/entropy"] == pytest.approx(sum(entropy) / 4, abs=1e-6)
    assert m["kl/ref_k3"] == pytest.approx(sum(k3) / 4, abs=1e-6)


def test_sft_loss_is_on_shifted_targets():
    """ids [0, 1, 2, 0(pad)], loss_mask on tokens 1 and 2: loss = -(log p(1|0) + log p(2|1)) / 2."""
    table = [[0.0, 1.0, 2.0], [0.5, -1.0, 0.3], [1.0, 1.0, -2.0]]
    model = TableModel(table)
    ids = np.array([[0, 1, 2, 0]], dtype=np.int64)
    m = sft_forward_backward(model, ids, np.array([[1, 1, 1, 0]]), np.array([[0, 1, 1, 0]], dtype=np.float32),
                             num_tokens=2)
    lp = [log_softmax(row) for row in table]
    assert m["loss/sft"] == pytest.approx(-(lp[0][1] + lp[1][2]) / 2, abs=1e-6)


def test_sft_eval_loss_hand_value_and_shares_add_up():
    """Held-out loss of two rows, no update: the mean NLL per target token. Row 0 targets
    p(1|0), p(2|1); row 1 targets p(0|2). Split over two 'ranks' with the global count, the
    shares add up to the whole (what the trainer group's merge relies on)."""
    from primitives.model.training import sft_eval_loss

    table = [[0.0, 1.0, 2.0], [0.5, -1.0, 0.3], [1.0, 1.0, -2.0]]
    model = TableModel(table)
    ids = np.array([[0, 1, 2, 0], [1, 2, 0, 0]], dtype=np.int64)
    attn = np.array([[1, 1, 1, 0], [1, 1, 1, 0]])
    mask = np.array([[0, 1, 1, 0], [0, 0, 1, 0]], dtype=np.float32)
    lp = [log_softmax(row) for row in table]
    expected = -(lp[0][1] + lp[1][2] + lp[2][0]) / 3
    whole = sft_eval_loss(model, ids, attn, mask, num_tokens=3)
    assert whole["eval/loss_sft"] == pytest.approx(expected, abs=1e-6) and whole["eval/sft_tokens"] == 3
    parts = [sft_eval_loss(model, ids[i:i + 1], attn[i:i + 1], mask[i:i + 1], num_tokens=3) for i in range(2)]
    assert parts[0]["eval/loss_sft"] == pytest.approx(-(lp[0][1] + lp[1][2]) / 3, abs=1e-6)
    assert sum(p["eval/loss_sft"] for p in parts) == pytest.approx(expected, abs=1e-6)
    assert all(p.grad is None for p in model.parameters())  # no gradient was taken


def test_dropout_is_off_in_every_logprob_forward(tokenizer):
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model
    from primitives.model.logprobs import completion_logprobs

    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2), 3)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    model.config.attention_dropout = 0.3
    ids = torch.tensor([tokenizer("12+34=46").input_ids] * 2)
    mask = torch.ones_like(ids)
    model.train()
    with torch.no_grad():  # dropout really is active before: two raw forwards differ
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    first, _ = completion_logprobs(model, ids, mask, 4)
    second, _ = completion_logprobs(model, ids, mask, 4)
    assert model.training and torch.equal(first, second)
    model.eval()
    assert torch.equal(completion_logprobs(model, ids, mask, 4)[0], first)


# ----------------------------------------------------------------------------- returns across tool spans

def test_returns_and_gae_carry_across_a_tool_span():
    """Policy tokens 0, 1, then tool output 2, 3, then policy tokens 4, 5, then padding."""
    mask = t([[1, 1, 0, 0, 1, 1, 0]])
    r = t([[0, 0, 0, 0, 0, 1.0, 0]])
    g = 0.9
    assert discounted_returns(r, mask, g).tolist()[0] == pytest.approx([g ** 3, g ** 2, 0, 0, g, 1.0, 0], abs=1e-6)
    values = t([[0.5, 0.4, 9.0, 9.0, 0.3, 0.2, 9.0]])  # garbage where masked
    adv, ret = gae_advantages(r, values, mask, gamma=1.0, lam=0.5)
    # A5 = 1 - 0.2 = 0.8; A4 = (0.2 - 0.3) + 0.5 * 0.8 = 0.3; tool span skipped;
    # A1 = (0.3 - 0.4) + 0.5 * 0.3 = 0.05; A0 = (0.4 - 0.5) + 0.5 * 0.05 = -0.075
    assert adv.tolist()[0] == pytest.approx([-0.075, 0.05, 0, 0, 0.3, 0.8, 0], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.425, 0.45, 0, 0, 0.6, 1.0, 0], abs=1e-6)


# ----------------------------------------------------------------------------- make_batch: no silent drops

def test_dr_grpo_divides_by_the_budget_not_the_padded_width():
    """Two steps whose longest completions differ (2 and 5 tokens) scale the same: by budget 8."""
    algo = algos.dr_grpo()
    for longest in (2, 5):
        rs = [rollout("a", "g", [1], [1] * longest, [0.0] * longest, reward=1.0),
              rollout("b", "g", [1], [1], [0.0], reward=0.0)]
        batch = make_batch(rs, algo, pad_id=0, budget=8)
        counts = step_counts(batch)
        assert counts.max_len == 8 and batch.loss_mask.shape[1] == longest
        ones = torch.ones(batch.loss_mask.shape)
        got = float(aggregate_loss(ones, torch.from_numpy(batch.loss_mask), algo.aggregation, counts))
        assert got == pytest.approx((longest + 1) / (2 * 8))


def test_kl_in_the_reward_moves_group_advantages():
    """Dr.GRPO with k1 KL in the reward, coef 0.5: rewards 1 and 0, sequence KLs 0.4 and 0.1,
    so shaped rewards 0.8 and -0.05, mean 0.375, advantages +-0.425 (not +-0.5)."""
    rs = [rollout("a", "g", [1], [1, 1], [-1.0, -1.0], reward=1.0, ref=[-1.2, -1.2]),
          rollout("b", "g", [1], [1], [-1.0], reward=0.0, ref=[-1.1])]
    algo = algos.dr_grpo(kl_coef=0.5, kl_in_reward=True, kl_fn="k1")
    batch = make_batch(rs, algo, pad_id=0, budget=4)
    np.testing.assert_allclose(batch.advantages, [[0.425, 0.425], [-0.425, 0.0]], atol=1e-6)
    assert batch.rewards.tolist() == [1.0, 0.0]  # logged rewards stay the task's


def test_overlong_rows_are_masked_not_dropped_and_dapo_sizes_from_the_budget():
    rs = [rollout("a", "g", [1], [1] * 9, [0.0] * 9, reward=1.0, finish="stop"),
          rollout("b", "g", [1], [1] * 10, [0.0] * 10, reward=1.0, finish="length"),
          rollout("c", "g", [1], [1] * 8, [0.0] * 8, reward=1.0, finish="stop")]
    algo = algos.dapo(filter_overlong=True)  # buffer 0.2 of the budget 10 = 2 tokens
    batch = make_batch(rs, algo, pad_id=0, budget=10)
    # penalties 0 at 8, -(9 - 8) / 2 at 9, -1 at 10; rewards 0.5, 0, 1: the truncated row stays in the statistics
    assert batch.rewards.tolist() == pytest.approx([0.5, 0.0, 1.0])
    centred = np.array([0.5, 0.0, 1.0]) - 0.5
    expected = centred / (np.sqrt((centred ** 2).sum() / 2) + 1e-6)
    assert batch.advantages[:, 0].tolist() == pytest.approx([expected[0], 0.0, expected[2]], abs=1e-5)
    assert batch.loss_mask.sum(1).tolist() == [9.0, 0.0, 8.0]
    assert step_counts(batch) == LossCounts(num_tokens=17, num_sequences=2, max_len=10, num_rows=3)
    with pytest.raises(ValueError, match="generation budget"):
        make_batch(rs, algos.dapo(), pad_id=0)
    # length counts policy tokens: 12 tokens of which 4 are tool output = 8 policy tokens, no penalty
    tool = rollout("t", "h", [1], [1] * 12, [0.0] * 12, reward=1.0, mask=[1] * 4 + [0] * 4 + [1] * 4)
    other = rollout("u", "h", [1], [1], [0.0], reward=0.0)
    assert make_batch([tool, other], algo, pad_id=0, budget=10).rewards.tolist() == [1.0, 0.0]


def test_kl_anywhere_needs_the_reference():
    assert not algos.uses_reference(algos.dapo()) and algos.uses_reference(algos.dapo(kl_coef=0.01))
    assert algos.uses_reference(algos.dr_grpo(kl_coef=0.1, kl_in_reward=True))
    assert algos.uses_reference(algos.online_dpo())
    with pytest.raises(ValueError, match="needs reference logprobs"):
        algos.grpo(kl_coef=0.1, needs_reference=False)


def test_gspo_refuses_token_aggregation_and_dual_clip():
    with pytest.raises(ValueError, match=r"is per sequence \(GSPO\)"):
        algos.gspo(aggregation="token-mean")
    with pytest.raises(ValueError, match="dual_clip"):
        algos.gspo(dual_clip=3.0)
    with pytest.raises(ValueError, match="is_level"):
        algos.grpo(is_level="tokens")


def test_len_of_a_batch_is_its_rows():
    rs = [rollout("a", "g", [1], [1, 1], [0.0, 0.0], reward=1.0), rollout("b", "g", [1], [1], [0.0], reward=0.0)]
    batch = make_batch(rs, algos.grpo(kl_coef=0.0), pad_id=0)
    assert len(batch) == batch.size == 2
    assert len(batch._replace(prompt_len=1).select([1])) == 1


def test_staleness_metrics_and_stale_groups_by_hand():
    from primitives.maths.metrics import stale_groups, staleness_metrics

    # policy version 5; lags 0, 0, 1, 3, 3 (groups a, a, b, c, c)
    rollouts = [SimpleNamespace(group=g, policy_version=v) for g, v in
                [("a", 5), ("a", 5), ("b", 4), ("c", 2), ("c", 2)]]
    m = staleness_metrics(rollouts, version=5)
    assert m == {"staleness/mean": pytest.approx(7 / 5), "staleness/max": 3.0, "staleness/lag_0": pytest.approx(0.4),
                 "staleness/lag_1": pytest.approx(0.2), "staleness/lag_2": 0.0, "staleness/lag_3": pytest.approx(0.4)}
    assert staleness_metrics([], 5) == {}
    assert stale_groups(rollouts, 5, max_staleness=1) == {"c"}
    assert stale_groups(rollouts, 5, max_staleness=0) == {"b", "c"}
    assert stale_groups(rollouts, 5, max_staleness=3) == set()
