"""Algorithms are records of functions: presets, replacing one function, checks, schedules."""
import functools

import pytest
import torch

from primitives.maths import advantages as adv
from primitives.maths import algorithms as A
from primitives.maths import losses as L
from primitives.maths.filters import all_pairs, dynamic_sampling_filter, top_bottom_pairs
from primitives.maths.kl import create_truncated_kl, kl_k1, kl_k3
from primitives.maths.objectives import gspo_policy_loss, online_dpo_objective, policy_objective, ppo_clip_policy_loss


def test_presets_are_records_of_their_papers_functions():
    d = A.dapo()
    assert (d.clip_eps_low, d.clip_eps_high, d.aggregation, d.filters, d.kl_coef) == (
        0.2, 0.28, L.token_mean, (dynamic_sampling_filter,), 0.0)
    g = A.grpo()
    assert (g.advantage_fn, g.aggregation, g.kl_fn, g.kl_in_reward, g.loss_fn, g.policy_loss_fn) == (
        adv.grpo_advantage, L.seq_mean_token_mean, kl_k3, False, policy_objective, ppo_clip_policy_loss)
    assert A.dr_grpo().aggregation is L.seq_mean_token_sum_norm and A.dr_grpo().advantage_fn is adv.dr_grpo_advantage
    assert A.reinforce_pp().kl_in_reward and A.reinforce_pp().kl_fn is kl_k1
    assert A.reinforce_pp(baseline=True).advantage_fn is adv.reinforce_pp_baseline_advantage
    assert A.gspo().policy_loss_fn is gspo_policy_loss and A.gspo().clip_eps_high == 4e-4
    o = A.online_dpo(beta=0.2)
    assert (o.dpo_beta, o.loss_fn, o.pair_selector) == (0.2, online_dpo_objective, top_bottom_pairs)
    assert A.pairwise(o) and not A.pairwise(g) and A.uses_reference(o) and not A.uses_reference(A.dapo())
    assert A.ppo().advantage_fn is adv.gae_advantage and A.needs_values(A.ppo()) and not A.needs_values(g)
    assert set(A.PRESETS) == {"grpo", "dapo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "gspo", "ppo",
                              "online_dpo"}


def my_advantage(x, algo):
    """A user's estimator: the raw reward on every token (no baseline)."""
    return adv.broadcast_to_tokens(x.rewards, x.mask), None


def my_algorithm():
    return A.grpo(kl_coef=0.0)._replace(name="raw_reward", advantage_fn=my_advantage)


def test_a_new_algorithm_is_a_preset_with_one_function_replaced():
    mine = A.grpo()._replace(kl_fn=create_truncated_kl(1.0))
    assert A.validate_algorithm(mine).kl_fn is not kl_k3
    # by name in a job config: functions by their short name or as module:function
    named = A.get_algorithm("rloo", kl_fn="k1", aggregation="seq-mean-token-mean",
                            advantage_fn="tests.primitives.test_algorithms:my_advantage")
    assert (named.kl_fn, named.aggregation, named.advantage_fn) == (kl_k1, L.seq_mean_token_mean, my_advantage)
    user = A.get_algorithm("tests.primitives.test_algorithms:my_algorithm", clip_eps_high=0.3)
    assert (user.name, user.advantage_fn, user.clip_eps_high) == ("raw_reward", my_advantage, 0.3)
    assert A.get_algorithm("dapo", filters="dynamic_sampling").filters == (dynamic_sampling_filter,)


def test_records_whose_functions_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm 'dpo'.*did you mean"):
        A.get_algorithm("dpo")
    with pytest.raises(ValueError, match="aggregation: unknown name 'mean'"):
        A.grpo(aggregation="mean")
    with pytest.raises(ValueError, match="unknown AlgorithmConfig field.*kl_coef"):
        A.grpo(kl_coeff=0.1)
    with pytest.raises(ValueError, match="pairwise and needs a pair_selector"):
        A.online_dpo(pair_selector=None)
    with pytest.raises(ValueError, match="not pairwise"):
        A.grpo(pair_selector=all_pairs)
    with pytest.raises(ValueError, match="GSPO.*seq-mean-token-mean"):
        A.gspo(aggregation=L.token_mean)
    for clip in (0.0, -0.1, None):  # 0 would hold every value that moved towards its return; None: a YAML null
        with pytest.raises(ValueError, match=rf"algorithm 'ppo': value_clip must be > 0, got {clip}"):
            A.ppo(value_clip=clip)
    with pytest.raises(ValueError, match="advantage_fn must be a function"):
        A.grpo(advantage_fn=3)
    with pytest.raises(ValueError, match="no callable 'nope'"):
        A.grpo(kl_fn="primitives.maths.kl:nope")


@pytest.mark.parametrize("name", sorted(A.PRESETS))
def test_every_preset_passes_its_sample_checks(name):
    A.check_algorithm_functions(A.get_algorithm(name))


def test_grpo_advantage_subtracts_the_sequence_kl_before_group_statistics():
    """Rewards 1 and 0, KL in the reward (coef 0.5) summing to 0.4 and 0.2 over each row:
    shaped 0.8 and -0.1, mean 0.35, unbiased std 0.45 * sqrt(2), so A = +-1/sqrt(2) on every
    loss token."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.3, 0.0], [0.2, 0.0, 0.0]])
    x = adv.AdvantageInputs(torch.tensor([1.0, 0.0]), ("a", "a"), mask, token_kl=kl)
    a, returns = adv.grpo_advantage(x, A.grpo(kl_coef=0.5, kl_in_reward=True))
    h = 0.45 / (0.45 * 2 ** 0.5 + 1e-6)
    torch.testing.assert_close(a, torch.tensor([[h, h, 0.0], [-h, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert returns is None


def test_gae_advantage_over_k1_token_rewards():
    """PPO's record: token rewards -0.5 * KL on each token and R = 1 on the last, values
    0.2 / 0.4 / 0.6, gamma 1, lambda 0.95: deltas 0.15, 0.1, 0.4; A = 0.606, 0.48, 0.4;
    returns A + V = 0.806, 0.88, 1.0."""
    x = adv.AdvantageInputs(torch.tensor([1.0]), ("a",), torch.ones(1, 3), token_kl=torch.tensor([[0.1, 0.2, 0.0]]),
                            values=torch.tensor([[0.2, 0.4, 0.6]]))
    a, returns = adv.gae_advantage(x, A.ppo(kl_coef=0.5))
    torch.testing.assert_close(a, torch.tensor([[0.606, 0.48, 0.4]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[0.806, 0.88, 1.0]]), atol=1e-6, rtol=0)


def test_function_signatures_are_checked_on_a_sample():
    bad_kl = A.grpo()._replace(kl_fn=lambda logp, ref: logp - ref)
    with pytest.raises(ValueError, match="kl_fn.*cannot be called with 3"):
        A.check_algorithm_functions(bad_kl)
    summed = A.grpo()._replace(kl_fn=lambda logp, ref, mask: (logp - ref).sum())
    with pytest.raises(ValueError, match=r"per-token \(B, T\) tensor"):
        A.check_algorithm_functions(summed)
    with pytest.raises(ValueError, match="advantage_fn.*cannot be called with 2"):
        A.check_algorithm_functions(A.grpo()._replace(advantage_fn=lambda rewards: rewards))
    partial = A.grpo()._replace(kl_fn=functools.partial(L.kl_penalty, estimator="k2"))
    A.check_algorithm_functions(partial)
    scalar_loss = A.grpo()._replace(policy_loss_fn=lambda logp, old, a, mask, algo: ((logp * a).sum(), None))
    with pytest.raises(ValueError, match=r"policy_loss_fn .* per-token \(B, T\) tensor"):
        A.check_algorithm_functions(scalar_loss)
    per_row = A.grpo()._replace(aggregation=lambda loss, mask, counts: loss.sum(-1))
    with pytest.raises(ValueError, match="aggregation .* must return a scalar"):
        A.check_algorithm_functions(per_row)


def test_piecewise_switch_and_kl_schedule():
    sched = A.piecewise_schedule([(0, A.grpo()), (10, A.dapo()), (20, A.online_dpo())])
    assert [sched(i, {}).name for i in (0, 9, 10, 19, 20, 100)] == ["grpo", "grpo", "dapo", "dapo", "online_dpo",
                                                                   "online_dpo"]
    with pytest.raises(ValueError, match="start at iteration 0"):
        A.piecewise_schedule([(5, A.grpo())])
    kl = A.linear_kl_schedule(A.grpo(), 0.1, 0.0, 10)
    assert [round(kl(i, {}).kl_coef, 6) for i in (0, 5, 10, 50)] == [0.1, 0.05, 0.0, 0.0]
    assert A.constant_schedule(A.rloo())(123, {}).name == "rloo"


def test_metric_switch_is_driven_by_the_last_metrics_and_sticks():
    sched = A.metric_switch_schedule(A.grpo(), A.dapo(), "reward/mean", 0.5)
    assert sched(0, {}).name == "grpo"
    assert sched(5, {"reward/mean": 0.49, "algorithm": "grpo"}).name == "grpo"
    assert sched(6, {"reward/mean": 0.5, "algorithm": "grpo"}).name == "dapo"
    assert sched(7, {"reward/mean": 0.1, "algorithm": "dapo"}).name == "dapo"  # sticky, from the logged name
    with pytest.raises(ValueError, match="different names"):
        A.metric_switch_schedule(A.grpo(), A.grpo(kl_coef=0.0))


def test_check_schedule_needs_iteration_and_metrics():
    assert A.check_schedule(A.constant_schedule(A.dapo())).name == "dapo"
    with pytest.raises(ValueError, match="algorithm_schedule.*cannot be called with 2"):
        A.check_schedule(lambda iteration: A.grpo())
    with pytest.raises(ValueError, match="returned dict"):
        A.check_schedule(lambda iteration, metrics: {})


def test_a_replaced_aggregation_reaches_the_loss():
    """The loss uses the record's aggregation function: a user's 'sum' aggregation gives the
    hand-worked token sum."""
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    a = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])
    from primitives.maths.objectives import LossInputs

    x = LossInputs(logp=logp, old_logp=None, advantages=a, mask=mask, counts=L.LossCounts(3, 2))
    summed = A.grpo(kl_coef=0.0)._replace(aggregation=lambda loss, m, counts: (loss * m).sum())
    loss, _ = policy_objective(x, summed)
    assert float(loss.detach()) == pytest.approx(-(1 + 1 - 2))  # ratio 1: per-token loss is -A, summed
    loss, _ = policy_objective(x, A.grpo(kl_coef=0.0))
    assert float(loss.detach()) == pytest.approx(-((1 + 1) / 2 + (-2) / 1) / 2)  # seq-mean-token-mean
