"""The PPO critic: values at the right positions, the clipped value loss by hand, micro-batch
equivalence, learning, save/load, and initialisation from a reward model."""
import os

import numpy as np
import pytest
import torch
from torch import nn

from primitives.maths.advantages import gae_advantages
from primitives.maths.losses import LossCounts
from primitives.model.training import optim_step
from primitives.model.value import (
    ValueModel,
    completion_values,
    load_value_model,
    rollout_values,
    save_value_model,
    value_forward_backward,
    value_model_from_policy,
    value_model_from_reward_model,
)
from primitives.padding import pack_completions
from primitives.types import Batch, Rollout


def _rollout(i, prompt_ids, completion_ids, reward=0.0):
    T = len(completion_ids)
    return Rollout(uid=f"e0/i{i}/s0", group=f"e0/i{i}", prompt="", prompt_ids=np.asarray(prompt_ids, np.int64),
                   completion_ids=np.asarray(completion_ids, np.int64), loss_mask=np.ones(T, np.float32),
                   logprobs=np.zeros(T, np.float32), reward=reward)


def _pad(arrays, T):
    return np.stack([np.pad(np.asarray(a, np.float32), (0, T - len(a))) for a in arrays]).astype(np.float32)


def _batch(rollouts, pad_id, values, returns=None, loss_mask=None):
    """A ``Batch`` in the trainer's layout; ``returns`` default to GAE (gamma 1, lambda 0.95)
    of the terminal rewards on ``values``."""
    ids, mask, P, T = pack_completions([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    lm = _pad([r.loss_mask for r in rollouts], T) if loss_mask is None else np.asarray(loss_mask, np.float32)
    v = _pad(values, T)
    if returns is None:
        token_r = np.zeros_like(v)
        for i, r in enumerate(rollouts):
            token_r[i, len(r.completion_ids) - 1] = r.reward
        _, ret = gae_advantages(torch.from_numpy(token_r), torch.from_numpy(v), torch.from_numpy(lm), 1.0, 0.95)
        returns = ret.numpy()
    B = len(rollouts)
    return Batch(rollouts=tuple(rollouts), input_ids=ids, attention_mask=mask, prompt_len=P, loss_mask=lm,
                 behaviour_logprobs=np.zeros((B, T), np.float32),
                 rewards=np.array([r.reward for r in rollouts], np.float32),
                 advantages=np.zeros((B, T), np.float32), values=v, returns=np.asarray(returns, np.float32))


def _counts(batch):
    return LossCounts(num_tokens=int(batch.loss_mask.sum()), num_sequences=batch.size)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.fixture()
def value_model(tiny_model):
    """A critic from the tiny policy with a random (not zero) head, so values differ per token."""
    return value_model_from_policy(tiny_model, head_init_std=0.5, seed=3)


def test_left_padding_does_not_change_a_rows_values(value_model, tokenizer):
    pad = tokenizer.pad_token_id
    a = _rollout(0, [5, 6, 7], [8, 9, 10])
    b = _rollout(1, [11, 12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22])
    alone = rollout_values(value_model, [a], pad)[0]
    together = rollout_values(value_model, [b, a], pad)  # a now has 4 tokens of left padding
    assert together[1].shape == (3,) and together[0].shape == (5,)
    np.testing.assert_allclose(together[1], alone, atol=1e-5, rtol=0)
    assert np.abs(alone).max() > 1e-2  # the comparison is not between zeros
    # (Qwen2's rotary attention sees relative positions only, so this checks that padding is
    # masked out; positions from the mask matter for absolute-position models.)


def test_value_of_completion_token_t_is_read_before_it(value_model, tokenizer):
    """V_t sits at position P-1+t: it does not depend on completion token t itself."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    v = completion_values(value_model, ids, mask, prompt_len=3)  # (1, 3)
    changed = ids.clone()
    changed[0, 4] = 30  # completion token 1
    v2 = completion_values(value_model, changed, mask, prompt_len=3)
    assert torch.equal(v[:, :2], v2[:, :2]) and not torch.allclose(v[:, 2], v2[:, 2])
    full = value_model(ids, mask)  # (1, 6)
    torch.testing.assert_close(v, full[:, 2:5], atol=0, rtol=0)


def test_zero_head_gives_zero_values(tiny_model, tokenizer):
    vm = value_model_from_policy(tiny_model)
    rs = [_rollout(0, [5, 6], [7, 8, 9]), _rollout(1, [10, 11, 12, 13], [14])]
    values = rollout_values(vm, rs, tokenizer.pad_token_id)
    assert [v.tolist() for v in values] == [[0.0, 0.0, 0.0], [0.0]]
    assert all(v.dtype == np.float32 for v in values)
    # a copy: the policy's own parameters are not the critic's
    assert vm.backbone.embed_tokens.weight.data_ptr() != tiny_model.model.embed_tokens.weight.data_ptr()


class _TableValues(nn.Module):
    """A value 'model' that returns a learnable table row per sequence, chosen by its first
    token id: values by hand, through the real micro-batching and loss code."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.tensor(table, dtype=torch.float32))  # (B, L)

    def forward(self, input_ids, attention_mask, position_ids=None):
        return self.table[input_ids[:, 0]]


def test_clipped_value_loss_by_hand():
    # P = 1, T = 3, L = 4: V_t is the table entry at position t (position 3 is never read).
    # Row 0: V = [0.5, 1.0, -0.3], old = [0.4, 0.5, 0.0], R = [1.0, 0.0, -1.0], all on the mask.
    #   t0: moves 0.1 <= 0.2, no clip: 0.5 * (0.5 - 1)^2 = 0.125
    #   t1: moves 0.5, V_clip = 0.7: max((1.0 - 0)^2, (0.7 - 0)^2) = 1.0 (unclipped branch) -> 0.5
    #   t2: moves -0.3, V_clip = -0.2: max((-0.3 + 1)^2 = 0.49, (-0.2 + 1)^2 = 0.64) -> clipped, 0.32
    # Row 1: V = [2.0, 0.0, 9.0], old = [1.0, 0.0, 0.0], R = [3.0, 0.1, 0.0], mask = [1, 1, 0].
    #   t0: moves 1.0, V_clip = 1.2: max((2 - 3)^2 = 1, (1.2 - 3)^2 = 3.24) -> clipped, 1.62
    #   t1: 0.5 * (0 - 0.1)^2 = 0.005;  t2 is off the mask (its 9.0 must not count)
    # token-mean over 5 tokens: (0.125 + 0.5 + 0.32 + 1.62 + 0.005) / 5 = 2.57 / 5 = 0.514
    table = [[0.5, 1.0, -0.3, 0.0], [2.0, 0.0, 9.0, 0.0]]
    model = _TableValues(table)
    rs = [_rollout(0, [0], [1, 2, 3]), _rollout(1, [1], [1, 2, 3])]  # first token = table row
    mask = [[1, 1, 1], [1, 1, 0]]
    batch = _batch(rs, pad_id=99, values=[[0.4, 0.5, 0.0], [1.0, 0.0, 0.0]],
                   returns=[[1.0, 0.0, -1.0], [3.0, 0.1, 0.0]], loss_mask=mask)
    m = value_forward_backward(model, batch, LossCounts(num_tokens=5, num_sequences=2), clip=0.2)
    assert m["critic/value_loss"] == pytest.approx(0.514, abs=1e-6)
    assert m["critic/clip_frac"] == pytest.approx(2 / 5, abs=1e-7)  # row 0 t2 and row 1 t0
    assert m["critic/values_mean"] == pytest.approx((0.5 + 1.0 - 0.3 + 2.0 + 0.0) / 5, abs=1e-6)
    assert m["critic/returns_mean"] == pytest.approx((1.0 + 0.0 - 1.0 + 3.0 + 0.1) / 5, abs=1e-6)
    # gradient / 5: unclipped tokens give (V - R); clipped ones (bound clamp) give 0
    expected = torch.tensor([[(0.5 - 1.0) / 5, (1.0 - 0.0) / 5, 0.0, 0.0], [0.0, (0.0 - 0.1) / 5, 0.0, 0.0]])
    torch.testing.assert_close(model.table.grad, expected, atol=1e-7, rtol=0)
    # with twice the global tokens (another rank holds the rest) this part's share halves
    model.table.grad = None
    half = value_forward_backward(model, batch, LossCounts(num_tokens=10, num_sequences=4), clip=0.2)
    assert half["critic/value_loss"] == pytest.approx(0.257, abs=1e-6)


def _ppo_batch(value_model, tokenizer):
    rng = np.random.default_rng(0)
    rs = [_rollout(i, rng.integers(5, 60, size=2 + i % 4), rng.integers(5, 60, size=1 + (3 * i) % 5),
                   reward=float(i % 3) - 1.0) for i in range(6)]
    values = rollout_values(value_model, rs, tokenizer.pad_token_id)
    # old values moved by +-0.3 on alternate tokens, so the clip binds on some tokens
    values = [v + 0.3 * (-1.0) ** np.arange(len(v)) for v in values]
    return _batch(rs, tokenizer.pad_token_id, values)


def test_one_call_equals_two_halves_with_global_counts(value_model, tokenizer):
    batch = _ppo_batch(value_model, tokenizer)
    counts = _counts(batch)
    value_model.zero_grad()
    whole = value_forward_backward(value_model, batch, counts)
    g_whole = _grads(value_model)
    assert 0.0 < whole["critic/clip_frac"] < 1.0  # both branches are exercised

    value_model.zero_grad()
    halves = [value_forward_backward(value_model, batch.select(rows), counts) for rows in (range(0, 2), range(2, 6))]
    torch.testing.assert_close(_grads(value_model), g_whole, atol=1e-6, rtol=1e-5)
    for key, value in whole.items():
        assert halves[0][key] + halves[1][key] == pytest.approx(value, abs=1e-6), key

    value_model.zero_grad()
    micro = value_forward_backward(value_model, batch, counts, micro_batch_size=4)
    torch.testing.assert_close(_grads(value_model), g_whole, atol=1e-6, rtol=1e-5)
    assert micro == pytest.approx(whole, abs=1e-6)


def test_missing_values_or_returns_is_a_clear_error(value_model, tokenizer):
    batch = _ppo_batch(value_model, tokenizer)
    with pytest.raises(ValueError, match="batch.values is None"):
        value_forward_backward(value_model, batch._replace(values=None), _counts(batch))
    with pytest.raises(ValueError, match="batch.returns is None"):
        value_forward_backward(value_model, batch._replace(returns=None), _counts(batch))


def test_adam_steps_learn_the_returns(tiny_model, tokenizer):
    """Rows whose completion starts with token 20 return +1, with token 40 return -1 (mean 0,
    so a bias alone cannot fit them): the critic must read the tokens. PPO-style, each update
    anchors the clip at the current values."""
    torch.manual_seed(0)
    vm = value_model_from_policy(tiny_model)
    rng = np.random.default_rng(1)
    rs = [_rollout(i, rng.integers(5, 60, size=3), [20 if i % 2 else 40, *rng.integers(5, 60, size=3)],
                   reward=1.0 if i % 2 else -1.0) for i in range(8)]
    returns = [np.full(4, r.reward, np.float32) for r in rs]
    opt = torch.optim.Adam(vm.parameters(), lr=3e-3)

    losses = []
    for _ in range(25):
        batch = _batch(rs, tokenizer.pad_token_id, rollout_values(vm, rs, tokenizer.pad_token_id), returns)
        m = value_forward_backward(vm, batch, _counts(batch), clip=0.2)
        optim_step(vm, opt, max_grad_norm=1.0)
        losses.append(m["critic/value_loss"])
    final = rollout_values(vm, rs, tokenizer.pad_token_id)
    final_mse = np.mean([(v - ret) ** 2 for v, ret in zip(final, returns)])
    assert losses[0] == pytest.approx(0.5, abs=1e-6)  # zero head: 0.5 * mean(R^2) = 0.5
    assert 0.5 * final_mse < 1e-2 * losses[0]  # observed: 0.5 -> about 1e-5


def test_save_load_round_trip(value_model, tokenizer, tmp_path):
    rs = [_rollout(0, [5, 6, 7], [8, 9]), _rollout(1, [10], [11, 12, 13, 14])]
    before = rollout_values(value_model, rs, tokenizer.pad_token_id)
    path = str(tmp_path / "critic")
    save_value_model(value_model, path)
    save_value_model(value_model, path)  # over an existing checkpoint: replaced whole
    assert sorted(os.listdir(tmp_path)) == ["critic"]  # no temp dirs left behind
    loaded = load_value_model(path)
    assert isinstance(loaded, ValueModel)
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in value_model.named_parameters()]
    after = rollout_values(loaded, rs, tokenizer.pad_token_id)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_not_a_model_directory_is_named(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        value_model_from_policy(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        value_model_from_reward_model(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_value_model(missing)


def test_policy_path_without_head_is_not_a_value_model(tiny_model_path):
    with pytest.raises(FileNotFoundError, match="not a saved value model"):
        load_value_model(tiny_model_path)
    vm = value_model_from_policy(tiny_model_path)
    assert vm.value_head.weight.abs().sum() == 0


def test_from_reward_model_value_at_last_token_is_the_score(tiny_model, tokenizer, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(**{**tiny_model.config.to_dict(), "num_labels": 1,
                            "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(config).eval()
    path = str(tmp_path / "rm")
    rm.save_pretrained(path)
    vm = value_model_from_reward_model(path)
    assert vm.value_head.bias is None  # Qwen2's score head has none

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        scores = rm(input_ids=ids, attention_mask=mask).logits[:, 0]  # (2,) at the last token
        values = vm(ids, mask)  # (2, 6)
    torch.testing.assert_close(values[:, -1], scores, atol=1e-5, rtol=0)
    assert scores.abs().min() > 1e-3

    # num_labels != 1 is refused, naming the path
    two = str(tmp_path / "rm2")
    Qwen2ForSequenceClassification(Qwen2Config(**{**config.to_dict(), "num_labels": 2})).save_pretrained(two)
    with pytest.raises(ValueError, match="rm2.*num_labels=2"):
        value_model_from_reward_model(two)


def test_a_policy_in_adapters_gives_a_full_critic_of_its_merged_weights(tiny_model, tokenizer):
    """A policy wrapped in LoRA adapters (``with_lora``, as README tells a notebook user to pass one): the
    critic is a full value model, every weight trainable, whose backbone computes the policy's hidden
    states, the adapters' share included (here B made non-zero, so the adapters change them); the policy,
    wrapper and adapters, is left as it was. Before, PEFT's attribute forwarding handed the whole LM to the
    critic as its backbone, frozen but for the adapters, and its forward failed."""
    import copy

    from primitives.model.lora import with_lora
    from primitives.types import LoraConfig

    policy = with_lora(copy.deepcopy(tiny_model), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    critic = value_model_from_policy(policy, head_init_std=0.5, seed=3)
    assert not hasattr(critic.backbone, "lm_head") and not any("lora" in n for n, _ in critic.named_parameters())
    assert all(p.requires_grad for p in critic.parameters())
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = policy.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state  # adapters on
        bare = tiny_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (hidden - bare).abs().max() > 1e-3  # the adapters count
        values = critic(ids, mask)
    torch.testing.assert_close(values, critic.value_head(hidden).squeeze(-1), rtol=0, atol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert [n for n, p in policy.named_parameters() if p.requires_grad] and \
        all("lora" in n for n, p in policy.named_parameters() if p.requires_grad)
