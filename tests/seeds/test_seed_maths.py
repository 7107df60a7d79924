"""The seeds' maths and algorithm-config names (``rl_primitives.seed_maths``) against hand-worked
values, and the loss shapes they refuse."""
import math

import numpy as np
import pytest
import torch

import rl_primitives as rp
from primitives.maths import advantages as adv
from primitives.types import Rollout

LN2 = math.log(2.0)
# policy sampled two tokens at p = 1/2 and 1/4; the reference gives them 1/4 and 1/2
LP, REF = [-LN2, -2 * LN2], [-2 * LN2, -LN2]
# KL(pi || ref) by k3: r = ref/pi = 1/2 then 2: (0.5 - 1 + ln 2) + (2 - 1 - ln 2) = 0.5
FORWARD = 0.5
# KL(ref || pi) by importance weighting: rho log rho - rho + 1 at rho = 1/2 and 2 = 1.5 ln 2 - 0.5
REVERSE = 1.5 * LN2 - 0.5


def test_forward_and_reverse_kl_of_one_sequence_as_lists():
    assert rp.compute_forward_kl(LP, REF) == pytest.approx(FORWARD, abs=1e-6)
    assert rp.compute_reverse_kl(LP, REF) == pytest.approx(REVERSE, abs=1e-6)
    assert rp.compute_forward_kl(LP, LP) == pytest.approx(0.0, abs=1e-7)


def test_kl_of_a_padded_batch_per_sequence():
    """seeds/001's shape: [B, T] tensors and a mask give [B]; a padded position with any values
    adds nothing."""
    lp = torch.tensor([LP + [-9.0], [-1.0, -2.0, -3.0]])
    ref = torch.tensor([REF + [-0.1], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.allclose(rp.compute_forward_kl(lp, ref, mask), torch.tensor([FORWARD, 0.0]), atol=1e-6)
    assert torch.allclose(rp.compute_reverse_kl(lp, ref, mask), torch.tensor([REVERSE, 0.0]), atol=1e-6)


def test_a_kl_fn_is_called_as_each_seed_calls_it():
    """seeds/000 (lists): kl_fn(p, q) is KL(p || q), so the reverse direction passes (ref, policy);
    seeds/001 (with a mask): always (policy, ref, mask)."""
    seen = []
    first = lambda a, b: seen.append((a[0], b[0])) or 7.0  # noqa: E731
    assert rp.compute_forward_kl(LP, REF, kl_fn=first) == 7.0
    assert rp.compute_reverse_kl(LP, REF, kl_fn=first) == 7.0
    assert seen == [(LP[0], REF[0]), (REF[0], LP[0])]
    assert rp.compute_reverse_kl(LP, REF, [1, 1], kl_fn=lambda a, b, m: seen.append((a[0], b[0], m)) or 8.0) == 8.0
    assert seen[-1] == (LP[0], REF[0], [1, 1])


def test_kl_of_different_tokens_is_refused():
    with pytest.raises(ValueError, match="same tokens.*error 3"):
        rp.compute_forward_kl([-1.0, -2.0], [-1.0])


def _rollout(logprobs, ref, loss_mask, uid="e0/i0/s0"):
    n = len(logprobs)
    return Rollout(uid, uid.rsplit("/", 1)[0], "p", np.zeros(1, np.int64), np.arange(n),
                   np.asarray(loss_mask, np.float32), np.asarray(logprobs, np.float32),
                   ref_logprobs=None if ref is None else np.asarray(ref, np.float32))


def test_batch_kl_per_rollout_over_its_loss_tokens():
    """The tool-output token (mask 0) between the two policy tokens is left out."""
    batch = rp.RolloutBatch((_rollout([LP[0], -5.0, LP[1]], [REF[0], -0.2, REF[1]], [1, 0, 1]),
                             _rollout([-1.0], [-1.0], [1], "e0/i1/s0")))
    assert rp.compute_batch_kl(batch) == pytest.approx([FORWARD, 0.0], abs=1e-6)
    assert rp.compute_batch_kl(batch, kl_fn=lambda a, b: float(len(a))) == [2.0, 1.0]
    with pytest.raises(ValueError, match="e0/i2/s0 has no ref_logprobs"):
        rp.compute_batch_kl([_rollout([-1.0], None, [1], "e0/i2/s0")])


def test_normalize_rewards():
    # mean 2, population std sqrt(2/3): (r - 2) / 0.8165 = -1.2247, 0, 1.2247
    assert rp.normalize_rewards([1.0, 2.0, 3.0]) == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], abs=1e-6)
    assert rp.normalize_rewards([0.5, 0.5]) == [0.0, 0.0]
    assert rp.normalize_rewards([1.0, 3.0], lambda r: [x / 3 for x in r]) == pytest.approx([1 / 3, 1.0])
    with pytest.raises(ValueError, match="finite"):
        rp.normalize_rewards([1.0, float("nan")])


def test_kl_schedule_falls_linearly_and_stays_at_its_floor():
    fn = rp.create_kl_schedule(0.1, 0.01, 100)
    assert [fn(0), fn(50), fn(100), fn(250)] == pytest.approx([0.1, 0.055, 0.01, 0.01])  # the seeds': -0.125 at 250
    with pytest.raises(ValueError, match="num_iterations"):
        rp.create_kl_schedule(num_iterations=0)


def test_algorithm_config_makers():
    g = rp.create_grpo_config(kl_coef=0.2)
    assert (g.name, g.kl_coef, g.advantage_fn) == ("grpo", 0.2, adv.grpo_advantage)
    centred = rp.create_grpo_config(normalize_advantages=False)
    assert centred.advantage_fn is adv.dr_grpo_advantage and centred.name == "grpo"
    p = rp.create_ppo_config(clip_range=0.3, kl_coef=0.01)
    assert (p.name, p.clip_eps_low, p.clip_eps_high, p.kl_coef) == ("ppo", 0.3, 0.3, 0.01)
    with pytest.raises(ValueError, match="critic_lr"):
        rp.create_ppo_config(value_loss_coef=0.5)
    with pytest.raises(ValueError, match="online_dpo"):
        rp.create_dapo_config(beta=0.1)
    switch = lambda i: "grpo" if i < 5 else "ppo"  # noqa: E731
    assert [rp.get_algorithm_config(i, switch).name for i in (0, 4, 5)] == ["grpo", "grpo", "ppo"]
    with pytest.raises(TypeError, match="not an algorithm name"):
        rp.get_algorithm_config(0, lambda i: 3)


def test_grpo_without_normalisation_centres_the_group_without_its_std():
    """rewards 1, 0, 0, 0 in one group: GRPO divides by the (unbiased) std, 0.5; the centred form
    does not."""
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0]), ["g"] * 4
    assert torch.allclose(adv.dr_grpo_advantages(rewards, groups), torch.tensor([0.75, -0.25, -0.25, -0.25]))


@pytest.mark.parametrize("name, error", [
    ("compute_ppo_loss", "error 5"), ("compute_policy_gradient_loss", "error 1"),
    ("compute_reinforce_loss", "'reinforce'"), ("compute_dapo_loss", "online_dpo")])
def test_losses_from_stored_logprobs_are_refused_with_the_form_that_works(name, error):
    with pytest.raises(TypeError, match="error 1") as raised:
        getattr(rp, name)([], [], [])
    message = str(raised.value)
    assert error in message and ("training_step" in message or "online_dpo_loss" in message)


def _scored(group: str, sample: int, reward: float) -> Rollout:
    return Rollout(uid=f"{group}/s{sample}", group=group, prompt="1+1=", prompt_ids=np.arange(4),
                   completion_ids=np.array([5, 6]), loss_mask=np.ones(2, np.float32),
                   logprobs=np.array([-0.1, -0.2], np.float32), finish_reason="stop", text="2", reward=reward)


def test_dapo_pairs_are_the_selectors_or_each_groups_best_against_its_worst():
    """Two prompts of three samples each; the second group ties (no pair); the default pairs the
    first group's 0.9 against its 0.1. A selector's pairs come back as they are, checked."""
    rollouts = [_scored("e0/i0", 0, 0.5), _scored("e0/i0", 1, 0.9), _scored("e0/i0", 2, 0.1),
                _scored("e0/i1", 0, 1.0), _scored("e0/i1", 1, 1.0), _scored("e0/i1", 2, 1.0)]
    batch = rp.RolloutBatch(tuple(rollouts))
    pairs = rp.compute_dapo_pairs(batch)
    assert [(a.uid, b.uid) for a, b in pairs] == [("e0/i0/s1", "e0/i0/s2")]
    mine = rp.compute_dapo_pairs(batch, lambda b: [(b.rollouts[0], b.rollouts[2])])
    assert [(a.uid, b.uid) for a, b in mine] == [("e0/i0/s0", "e0/i0/s2")]
    with pytest.raises(ValueError, match="pair 0 joins rollouts of prompts e0/i0 and e0/i1"):
        rp.compute_dapo_pairs(batch, lambda b: [(b.rollouts[0], b.rollouts[3])])
    with pytest.raises(TypeError, match="pair_selector's item 0 is Rollout, not a"):
        rp.compute_dapo_pairs(batch, lambda b: [b.rollouts[0]])


def test_the_seeds_loss_dispatch_is_refused_naming_the_preset():
    with pytest.raises(TypeError, match=r"compute_loss_by_algorithm\(batch, \{'algorithm': 'grpo', ...\}\).*no "
                                        r"gradient.*create_algorithm_config\('grpo'\)"):
        rp.compute_loss_by_algorithm(None, {"algorithm": "grpo", "params": {}})
    with pytest.raises(TypeError, match="its 'dapo' is the pairwise DPO loss, online_dpo here: error 4"):
        rp.compute_loss_by_algorithm(None, {"algorithm": "dapo", "params": {}})
