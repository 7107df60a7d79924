"""Advantage estimators against hand-worked values; GAE batched vs a scalar loop."""
import pytest
import torch

from primitives.maths import advantages as A

# two interleaved groups: a = [1, 0, 0, 0], b = [1, 1, 0, 1]
GROUPS = ["a", "b", "a", "b", "a", "b", "a", "b"]
R = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])


def test_grpo_hand_values():
    # a: mean 0.25, unbiased std 0.5 -> [1.5, -0.5, -0.5, -0.5]; b: mean .75, std .5 -> [.5, .5, -1.5, .5]
    out = A.grpo_advantages(R, GROUPS, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([1.5, 0.5, -0.5, 0.5, -0.5, -1.5, -0.5, 0.5]))


def test_dr_grpo_and_rloo_hand_values():
    torch.testing.assert_close(A.dr_grpo_advantages(R, GROUPS),
                               torch.tensor([0.75, 0.25, -0.25, 0.25, -0.25, -0.75, -0.25, 0.25]))
    # RLOO: R_i - mean of the other three
    third = 1.0 / 3.0
    torch.testing.assert_close(A.rloo_advantages(R, GROUPS),
                               torch.tensor([1.0, third, -third, third, -third, -1.0, -third, third]))


@pytest.mark.parametrize("fn", [A.grpo_advantages, A.dr_grpo_advantages, A.rloo_advantages])
def test_group_advantages_sum_to_zero(fn):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(60, generator=g)
    groups = [f"p{i % 12}" for i in range(60)]
    adv = fn(rewards, groups)
    sums = torch.zeros(12).index_add_(0, torch.tensor([i % 12 for i in range(60)]), adv)
    torch.testing.assert_close(sums, torch.zeros(12), atol=1e-5, rtol=0)


def test_equal_rewards_give_zero_advantage():
    out = A.grpo_advantages(torch.tensor([0.5, 0.5, 0.5]), ["g"] * 3)
    torch.testing.assert_close(out, torch.zeros(3))


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="group 'solo' has 1 rollout"):
        A.grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), ["x", "x", "solo"])
    with pytest.raises(ValueError, match="non-finite reward nan at position 1"):
        A.rloo_advantages(torch.tensor([1.0, float("nan")]), ["x", "x"])
    with pytest.raises(ValueError, match="do not match"):
        A.dr_grpo_advantages(torch.tensor([1.0, 0.0]), ["x"])


def test_token_rewards_and_returns():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    r = A.token_rewards(torch.tensor([1.0]), mask, kl, kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 0.9, 0.0]]))
    ret = A.discounted_returns(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    ret = A.discounted_returns(A.token_rewards(torch.tensor([1.0]), mask), mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0, 0.0]]))


def test_reinforce_pp_is_whitened_over_valid_tokens():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = A.reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, gamma=1.0)
    # returns [[1,1,1],[0,0,0]] -> mean 0.6, std sqrt(0.24)
    s = 0.24 ** 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.4 / s, 0.4 / s, 0.4 / s], [-0.6 / s, -0.6 / s, 0.0]]),
                               atol=1e-5, rtol=0)
    # baseline variant: group mean removed first; a uniform group gives zero returns before whitening
    base = A.reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, groups=["g", "g"])
    assert float((base * mask).sum()) == pytest.approx(0.0, abs=1e-5)


def test_gae_hand_values():
    # delta = [0.1, 0.1, 0.3]; A2 = .3, A1 = .1 + .5*.3 = .25, A0 = .1 + .5*.25 = .225
    adv, ret = A.gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                                torch.ones(1, 3), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0]]))


def _gae_loop(r, v, n, gamma, lam):
    """Scalar reference: one row, valid length n."""
    out = [0.0] * len(r)
    nxt_a, nxt_v = 0.0, 0.0
    for t in reversed(range(n)):
        delta = r[t] + gamma * nxt_v - v[t]
        nxt_a = delta + gamma * lam * nxt_a
        out[t], nxt_v = nxt_a, v[t]
    return out


def test_batched_gae_equals_scalar_loop_with_padding():
    g = torch.Generator().manual_seed(3)
    B, T = 6, 9
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = [9, 1, 4, 7, 2, 9]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    adv, _ = A.gae_advantages(r * mask, v, mask, gamma=0.97, lam=0.9)
    expected = torch.tensor([_gae_loop((r[i] * mask[i]).tolist(), v[i].tolist(), lengths[i], 0.97, 0.9)
                             for i in range(B)])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = A.masked_whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4, rtol=0)


def test_constant_baseline_hand_values_one_completion_per_prompt():
    """REINFORCE with a constant baseline: R - b on every loss token, 0 off the mask; the KL in the
    reward (a sequence's summed token KL times kl_coef) is subtracted first. Groups of one are fine."""
    from primitives.maths.algorithms import reinforce

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    rewards = torch.tensor([1.0, 0.0, 0.25])
    algo = reinforce(baseline=0.5)
    out, returns = algo.advantage_fn(A.AdvantageInputs(rewards, ("p0", "p1", "p2"), mask), algo)
    assert returns is None
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, -0.25, -0.25]]),
                               rtol=0, atol=0)
    # KL in the reward, coef 0.1: sequence KLs 0.3+0.1 = 0.4, 2.0, 0.5 -> rewards 0.96, -0.2, 0.2
    kl = torch.tensor([[0.3, 0.1, 0.0], [2.0, 0.0, 0.0], [0.0, 0.2, 0.3]])
    with_kl = algo._replace(kl_coef=0.1, kl_in_reward=True)
    out, _ = with_kl.advantage_fn(A.AdvantageInputs(rewards, ("p0", "p1", "p2"), mask, token_kl=kl), with_kl)
    torch.testing.assert_close(out, torch.tensor([[0.46, 0.46, 0.0], [-0.7, 0.0, 0.0], [0.0, -0.3, -0.3]]),
                               rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="constant_baseline: baseline must be finite, got inf"):
        A.constant_baseline(float("inf"))


@pytest.mark.parametrize("name, need", [("grpo", 2), ("dapo", 2), ("dr_grpo", 2), ("rloo", 2), ("online_dpo", 2),
                                        ("reinforce", 1), ("reinforce_pp", 1), ("ppo", 1), ("gspo", 2)])
def test_min_group_size_of_each_preset(name, need):
    """The fewest completions per prompt each preset learns from: group estimators and pairs need
    two, a constant baseline, REINFORCE++'s batch whitening and PPO's critic one."""
    from primitives.maths.algorithms import get_algorithm, min_group_size

    assert min_group_size(get_algorithm(name)) == need
    assert min_group_size(get_algorithm("reinforce_pp", baseline=True)) == 2  # the group mean as its baseline


def test_constant_baseline_travels_to_actors():
    import cloudpickle

    from primitives.maths.algorithms import check_algorithm_picklable, reinforce

    algo = reinforce(baseline=0.25)
    check_algorithm_picklable(algo)
    again = cloudpickle.loads(cloudpickle.dumps(algo.advantage_fn))
    assert again.baseline == 0.25 and again.__name__ == "constant_baseline(0.25)"
