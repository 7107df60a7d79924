"""The seeds' model-side helpers (seeds/000 and 001): logprobs of generated tokens, a reference
moved by an update function, GAE advantages of a batch, thinking split from the answer. Each
delegates to the project's primitives (``primitives.model``, ``primitives.maths``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.maths.advantages import gae_advantages
from primitives.maths.kl import apply_ref_state, ref_state_from_model
from primitives.model.logprobs import completion_logprobs
from rl_primitives.api import check_ref_update_fn


def compute_logprobs_for_tokens(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                                generated_ids: torch.Tensor, pad_token_id: int, micro_batch_size: int = 8,
                                temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` logprobs of ``generated_ids`` after left-padded prompts (``prompt_mask`` 0 on the
    padding), ``micro_batch_size`` rows per forward pass, at ``temperature`` (the sampling one: a
    reference scored at another temperature is of another distribution). Positions after a
    completion's end (``pad_token_id``) hold the value of the pad token: mask them out. Gradients
    flow unless the caller disables them (``primitives.model.logprobs.completion_logprobs``)."""
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.shape[0] != generated_ids.shape[0]:
        raise ValueError(f"compute_logprobs_for_tokens: prompt_ids {tuple(prompt_ids.shape)}, prompt_mask "
                         f"{tuple(prompt_mask.shape)} and generated_ids {tuple(generated_ids.shape)} must share rows")
    ids = torch.cat([prompt_ids, generated_ids], dim=1)
    mask = torch.cat([prompt_mask.to(torch.long), (generated_ids != pad_token_id).to(torch.long)], dim=1)
    logp, _ = completion_logprobs(model, ids, mask, prompt_ids.shape[1], temperature, micro_batch_size)
    return logp


def update_reference_model(ref_model, policy_model, update_fn: Callable, step: int = 0,
                           kl: Optional[float] = None):
    """``ref_model`` moved in place by ``update_fn(ref_state, policy_weights, step, kl) -> ref_state``
    (``create_ref_update_fn('ema', decay=0.99)``, ``create_periodic_updater(every)``, ...), and
    returned. The seeds' ``update_fn(ref, policy)`` shape is refused: an update needs the step
    explicit (a periodic reset) and must not keep hidden counters (seeds README error 9)."""
    fn = check_ref_update_fn(update_fn)
    policy = {k: v.detach() for k, v in policy_model.named_parameters()}
    apply_ref_state(ref_model, fn(ref_state_from_model(ref_model, step), policy, step, kl))
    return ref_model


def compute_ppo_advantages(batch, value_fn: Callable, gamma: float = 0.99, gae_lambda: float = 0.95) -> tuple:
    """``(advantages, returns)`` of each rollout of ``batch`` by GAE (``primitives.maths.advantages.
    gae_advantages``): the rollout's reward at its last loss token, ``value_fn(rollout)`` the value of
    each completion token (``(T,)``) or one value for the whole completion (a float: the one-step
    case, ``A = R - V``). Tool-output tokens (loss mask 0) are skipped, not terminals. Per-token
    arrays, or floats for a float value. PPO in training is ``create_algorithm_config('ppo')``
    with a critic."""
    rollouts = getattr(batch, "rollouts", batch)
    advantages, returns = [], []
    for r in rollouts:
        if r.reward is None:
            raise ValueError(f"compute_ppo_advantages: rollout {r.uid} has no reward; score the batch first")
        value = value_fn(r)
        if np.ndim(value) == 0:
            advantages.append(float(r.reward) - float(value))
            returns.append(float(r.reward))
            continue
        mask = torch.as_tensor(np.asarray(r.loss_mask, np.float32))[None]
        if not bool(mask.any()):
            raise ValueError(f"compute_ppo_advantages: rollout {r.uid} has no policy token (its loss mask is all 0): "
                             "nothing to give an advantage to")
        values = torch.as_tensor(np.asarray(value, np.float32))[None]
        if values.shape != mask.shape:
            raise ValueError(f"compute_ppo_advantages: value_fn gave {values.shape[1]} values for rollout {r.uid}'s "
                             f"{mask.shape[1]} completion tokens")
        token_r = torch.zeros_like(mask)
        token_r[0, int(torch.nonzero(mask[0]).max())] = float(r.reward)
        a, ret = gae_advantages(token_r, values, mask, gamma, gae_lambda)
        advantages.append(a[0].numpy())
        returns.append(ret[0].numpy())
    return advantages, returns


def parse_thinking(token_ids: Sequence[int], tokenizer, end: str = "</think>") -> tuple:
    """``(thinking, response)`` of a completion that thinks first (Qwen3's ``<think>...</think>``):
    split after the last ``end`` - its token where the tokenizer has one (Qwen3's 151668), else in
    the decoded text - the tags left out and both stripped; no ``end``: no thinking."""
    ids = list(token_ids)
    end_id = tokenizer.convert_tokens_to_ids(end) if end in tokenizer.get_vocab() else None
    if end_id is not None:
        cut = len(ids) - ids[::-1].index(end_id) if end_id in ids else 0
        thinking = tokenizer.decode(ids[:max(cut - 1, 0)], skip_special_tokens=True)
        response = tokenizer.decode(ids[cut:], skip_special_tokens=True)
    else:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        thinking, _, response = text.rpartition(end)
    return thinking.replace("<think>", "").strip(), response.strip()
