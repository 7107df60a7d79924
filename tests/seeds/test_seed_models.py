"""The seeds' model-side helpers (``rl_primitives.seed_models``) against a second computation or
hand-worked values."""
import numpy as np
import pytest
import torch

import rl_primitives as rp
from primitives.model.logprobs import rollout_logprobs
from primitives.types import Rollout


def _rollout(prompt, completion, k=0, reward=None, mask=None):
    n = len(completion)
    return Rollout(f"e0/i{k}/s0", f"e0/i{k}", "p", np.asarray(prompt, np.int64), np.asarray(completion, np.int64),
                   np.ones(n, np.float32) if mask is None else np.asarray(mask, np.float32), np.zeros(n, np.float32),
                   reward=reward)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_for_tokens_equal_the_rollouts_scored_whole(tiny_model, tokenizer, temperature):
    pad = tokenizer.pad_token_id
    rows = [_rollout([5, 6, 7], [8, 9, 10]), _rollout([11], [12, 13], 1)]  # prompts of 3 and 1, completions 3 and 2
    prompt_ids = torch.tensor([[5, 6, 7], [pad, pad, 11]])
    prompt_mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    generated = torch.tensor([[8, 9, 10], [12, 13, pad]])
    with torch.no_grad():
        logp = rp.compute_logprobs_for_tokens(tiny_model, prompt_ids, prompt_mask, generated, pad, 1, temperature)
    want = rollout_logprobs(tiny_model, rows, pad, temperature)
    assert logp.shape == (2, 3)
    np.testing.assert_allclose(logp[0].numpy(), want[0], atol=1e-5)
    np.testing.assert_allclose(logp[1, :2].numpy(), want[1], atol=1e-5)
    with pytest.raises(ValueError, match="must share rows"):
        rp.compute_logprobs_for_tokens(tiny_model, prompt_ids, prompt_mask, generated[:1], pad)


def test_update_reference_model_moves_it_by_our_update_fn(tiny_model):
    policy = rp.create_reference_model(tiny_model)
    ref = rp.create_reference_model(tiny_model)
    name, p = next(iter(policy.named_parameters()))
    with torch.no_grad():
        p.add_(1.0)  # the policy moved by 1 in one tensor
    before = dict(ref.named_parameters())[name].detach().clone()
    out = rp.update_reference_model(ref, policy, rp.create_ref_update_fn("ema", decay=0.75), step=1)
    assert out is ref
    torch.testing.assert_close(dict(ref.named_parameters())[name], before + 0.25, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="ref_update_fn\\(ref_state, policy_weights, step, kl\\)"):
        rp.update_reference_model(ref, policy, lambda r, pol: r)


def test_ppo_advantages_by_gae_hand_worked():
    """values 0.5, 0.6, 0.7, reward 1 at the last token, gamma 1, lambda 0.95: deltas 0.1, 0.1, 0.3;
    A = 0.1 + 0.95 (0.1 + 0.95 * 0.3), 0.1 + 0.95 * 0.3, 0.3; returns A + V."""
    batch = [_rollout([1], [2, 3, 4], reward=1.0), _rollout([1], [2, 3, 4], 1, reward=1.0, mask=[1, 0, 1])]
    values = {"e0/i0/s0": [0.5, 0.6, 0.7], "e0/i1/s0": [0.5, 9.0, 0.7]}
    adv, ret = rp.compute_ppo_advantages(batch, lambda r: values[r.uid], gamma=1.0, gae_lambda=0.95)
    np.testing.assert_allclose(adv[0], [0.46575, 0.385, 0.3], atol=1e-6)
    np.testing.assert_allclose(ret[0], [0.96575, 0.985, 1.0], atol=1e-6)
    # the tool token (mask 0) is skipped: delta_0 = 0.7 - 0.5, A_0 = 0.2 + 0.95 * 0.3
    np.testing.assert_allclose(adv[1], [0.485, 0.0, 0.3], atol=1e-6)
    assert rp.compute_ppo_advantages(batch[:1], lambda r: 0.25) == ([0.75], [1.0])  # one value: A = R - V
    with pytest.raises(ValueError, match="no reward"):
        rp.compute_ppo_advantages([_rollout([1], [2])], lambda r: 0.0)
    with pytest.raises(ValueError, match="2 values for rollout e0/i0/s0's 3"):
        rp.compute_ppo_advantages(batch[:1], lambda r: [0.1, 0.2])


def test_parse_thinking_in_text_and_by_its_token(tokenizer):
    ids = tokenizer("<think>plan it</think> 42", add_special_tokens=False).input_ids
    assert rp.parse_thinking(ids, tokenizer) == ("plan it", "42")
    assert rp.parse_thinking(tokenizer("42", add_special_tokens=False).input_ids, tokenizer) == ("", "42")

    class Words:  # a tokenizer whose "</think>" is one token (Qwen3's)
        vocab = {"<think>": 0, "plan": 1, "</think>": 2, "42": 3}

        def get_vocab(self):
            return self.vocab

        def convert_tokens_to_ids(self, token):
            return self.vocab[token]

        def decode(self, ids, skip_special_tokens=True):
            words = {v: k for k, v in self.vocab.items()}
            return " ".join(words[i] for i in ids)

    assert rp.parse_thinking([0, 1, 2, 3], Words()) == ("plan", "42")
    assert rp.parse_thinking([3], Words()) == ("", "42")


def test_the_plans_grpo_loss_hand_worked():
    """Row 0: logits (0, 0) then (0, ln 3), labels 0 then 1: logprobs -ln 2 and ln 3/4, mean -0.4904,
    advantage 2. Row 1: (0, 0), label 1, its second token masked: -ln 2, advantage -1. The loss is
    minus the mean of the two products; its gradient reaches the logits."""
    import math

    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]], [[0.0, 0.0], [5.0, -5.0]]], requires_grad=True)
    labels, mask = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    row0 = (-math.log(2.0) + math.log(0.75)) / 2
    want = -((row0 * 2.0) + (-math.log(2.0) * -1.0)) / 2
    loss = rp.grpo_loss(logits, labels, mask, torch.tensor([2.0, -1.0]))
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    assert logits.grad[1, 1].abs().sum() == 0 and logits.grad[0].abs().sum() > 0  # the masked token has no say
