"""Algorithm presets and schedules."""
import pytest

from primitives import algorithms as A


def test_presets_have_their_papers_settings():
    d = A.dapo()
    assert (d.clip_eps_low, d.clip_eps_high, d.aggregation, d.dynamic_sampling, d.kl_coef) == (
        0.2, 0.28, "token-mean", True, 0.0)
    g = A.grpo()
    assert (g.advantage, g.aggregation, g.kl_estimator, g.kl_in_reward) == ("grpo", "seq-mean-token-mean", "k3", False)
    assert A.dr_grpo().aggregation == "seq-mean-token-sum-norm" and A.dr_grpo().advantage == "dr_grpo"
    assert A.reinforce_pp().kl_in_reward and A.reinforce_pp(baseline=True).advantage == "reinforce_pp_baseline"
    assert A.gspo().policy_loss == "gspo" and A.gspo().clip_eps_high == 4e-4
    assert A.online_dpo(beta=0.2).dpo_beta == 0.2 and A.online_dpo().policy_loss == "online_dpo"
    assert A.ppo().advantage == "gae"
    assert set(A.PRESETS) == {"grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "ppo", "online_dpo"}


def test_overrides_and_validation():
    assert A.grpo(kl_coef=0.0).kl_coef == 0.0
    with pytest.raises(ValueError, match="unknown algorithm 'dpo'"):
        A.get_algorithm("dpo")
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        A.grpo(aggregation="mean")
    with pytest.raises(ValueError, match="unknown AlgorithmConfig field"):
        A.grpo(kl_coeff=0.1)
    with pytest.raises(ValueError, match="unknown advantage"):
        A.make_algorithm("x", advantage="vtrace")


def test_piecewise_switch_and_kl_schedule():
    sched = A.piecewise_schedule([(0, A.grpo()), (10, A.dapo()), (20, A.online_dpo())])
    assert [sched(i).name for i in (0, 9, 10, 19, 20, 100)] == ["grpo", "grpo", "dapo", "dapo", "online_dpo",
                                                               "online_dpo"]
    with pytest.raises(ValueError, match="start at iteration 0"):
        A.piecewise_schedule([(5, A.grpo())])
    kl = A.linear_kl_schedule(A.grpo(), 0.1, 0.0, 10)
    assert [round(kl(i).kl_coef, 6) for i in (0, 5, 10, 50)] == [0.1, 0.05, 0.0, 0.0]
    assert A.constant_schedule(A.rloo())(123).name == "rloo"
