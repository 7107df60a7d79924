"""Losses against hand-worked values; sharded aggregation equals the global one."""
import math

import pytest
import torch

from primitives.maths import losses as L


def test_ppo_clip_higher_hand_values():
    ratio = torch.tensor([[1.5, 0.5, 1.0, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = L.ppo_clip_loss(ratio.log(), torch.zeros_like(ratio), adv, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 1.0, 1.5]]))
    assert clipped.tolist() == [[True, False, False, False]]


def test_ppo_dual_clip_bounds_negative_advantages():
    ratio = torch.tensor([[4.0, 4.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, clipped = L.ppo_clip_loss(ratio.log(), torch.zeros(1, 2), adv, 0.2, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2]]))
    assert clipped.tolist() == [[True, True]]
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        L.ppo_clip_loss(ratio.log(), torch.zeros(1, 2), adv, dual_clip=0.5)


def test_ppo_clip_gradient_zero_when_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = L.ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]]))


AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [("token-mean", 2.5), ("seq-mean-token-mean", 3.0),
                                           ("seq-mean-token-sum-norm", 10.0 / 6.0)])
def test_aggregation_hand_values(mode, expected):
    counts = L.LossCounts(num_tokens=4, num_sequences=2, max_len=3)
    assert float(L.aggregate_loss(AGG_LOSS, AGG_MASK, mode, counts)) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_sharded_aggregation_equals_global(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 10, 7
    x = torch.randn(B, T, generator=g, requires_grad=True)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    counts = L.LossCounts(int(mask.sum()), B, T)
    global_loss = L.aggregate_loss(x ** 2, mask, mode, counts)
    (g_global,) = torch.autograd.grad(global_loss, x)
    shards = [range(0, 3), range(3, 4), range(4, 10)]  # uneven ranks
    total = sum(L.aggregate_loss(x[list(s)] ** 2, mask[list(s)], mode, counts) for s in shards)
    (g_sharded,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, global_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_sharded, g_global, atol=1e-7, rtol=1e-6)


def test_unknown_aggregation_named():
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        L.aggregate_loss(AGG_LOSS, AGG_MASK, "sum", L.LossCounts(4, 2))


def test_gspo_sequence_ratio_and_gradient():
    logp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    s = math.exp(0.1)  # exp(mean(logp - old)) = 1.10517
    loss, clipped = L.gspo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), mask, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-s, -s]]))
    assert not clipped.any()
    L.aggregate_loss(loss, mask, "seq-mean-token-mean", L.LossCounts(2, 1)).backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2]]))  # GSPO: s * mean grad log pi
    loss_c, clipped_c = L.gspo_loss(logp.detach(), torch.zeros(1, 2), torch.ones(1, 2), mask, 0.05, 0.05)
    torch.testing.assert_close(loss_c, torch.tensor([[-1.05, -1.05]]))
    assert clipped_c.all()


def test_online_dpo_hand_value():
    loss, margin = L.online_dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
                                     torch.tensor([-2.0]), beta=0.5)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # -log sigmoid(1)
    assert float(margin) == pytest.approx(1.0)


def test_clipped_value_loss_hand_value():
    out = L.clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]]),
                               torch.ones(1, 1), clip=0.2)
    torch.testing.assert_close(out, torch.tensor([[0.845]]))  # 0.5 * (0.7 - 2)^2


def test_sft_loss_and_entropy_bonus():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert float(L.sft_loss(logp, mask)) == pytest.approx(2.0)
    assert float(L.sft_loss(logp, mask, num_tokens=6)) == pytest.approx(1.0)
    torch.testing.assert_close(L.entropy_bonus(torch.tensor([[0.5, 0.7]]), torch.tensor([[1.0, 0.0]])),
                               torch.tensor([[-0.5, 0.0]]))
