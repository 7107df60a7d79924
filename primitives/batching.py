"""From scored rollouts to the padded ``Batch`` one training step consumes (pure)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives import advantages as adv
from primitives.filters import PAIR_SELECTORS, overlong_filter, select_pairs
from primitives.kl import get_kl_fn
from primitives.logprobs import pack_completions
from primitives.rewards import overlong_penalty
from primitives.types import AlgorithmConfig, Batch


def pad_right(arrays: Sequence[np.ndarray], T: int, dtype=np.float32) -> np.ndarray:
    out = np.zeros((len(arrays), T), dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


def check_rollouts(rollouts: Sequence) -> None:
    """Shape and value checks that name the offending rollout."""
    if not rollouts:
        raise ValueError("no rollouts to batch")
    for r in rollouts:
        T = len(r.completion_ids)
        for name in ("loss_mask", "logprobs") + (("ref_logprobs",) if r.ref_logprobs is not None else ()):
            if len(getattr(r, name)) != T:
                raise ValueError(f"rollout {r.uid}: {name} has length {len(getattr(r, name))}, "
                                 f"completion_ids has {T}")
        if len(r.prompt_ids) == 0:
            raise ValueError(f"rollout {r.uid}: empty prompt_ids")
        if r.reward is None or not np.isfinite(r.reward):
            raise ValueError(f"rollout {r.uid}: reward is {r.reward!r}; expected a finite float")


def collate(rollouts: Sequence, advantages_BT: np.ndarray, pad_id: int,
            returns: Optional[np.ndarray] = None, values: Optional[np.ndarray] = None) -> Batch:
    """Pad rollouts into the Batch layout (prompts left, completions right)."""
    ids, attn, P, T = pack_completions([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    loss_mask = pad_right([r.loss_mask for r in rollouts], T)
    has_ref = all(r.ref_logprobs is not None for r in rollouts)
    return Batch(
        rollouts=tuple(rollouts), input_ids=ids, attention_mask=attn, prompt_len=P,
        loss_mask=loss_mask, old_logprobs=pad_right([r.logprobs for r in rollouts], T),
        rewards=np.asarray([r.reward for r in rollouts], dtype=np.float32),
        advantages=(advantages_BT[:, :T] * loss_mask).astype(np.float32),
        ref_logprobs=pad_right([r.ref_logprobs for r in rollouts], T) if has_ref else None,
        returns=returns, values=values,
    )


def compute_advantages(rollouts: Sequence, algo: AlgorithmConfig, kl_fn: Optional[Callable] = None,
                       values: Optional[Sequence[np.ndarray]] = None):
    """``(advantages (B, T), returns (B, T) or None)`` numpy, by ``algo.advantage``."""
    T = max(1, max(len(r.completion_ids) for r in rollouts))
    mask = torch.from_numpy(pad_right([r.loss_mask for r in rollouts], T))
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    groups = [r.group for r in rollouts]
    kl = None
    if algo.kl_in_reward and algo.kl_coef:
        if any(r.ref_logprobs is None for r in rollouts):
            raise ValueError(f"algorithm '{algo.name}' puts KL in the reward but rollouts lack ref_logprobs")
        kl = (kl_fn or get_kl_fn(algo.kl_estimator))(
            torch.from_numpy(pad_right([r.logprobs for r in rollouts], T)),
            torch.from_numpy(pad_right([r.ref_logprobs for r in rollouts], T)), mask)
    returns = None
    if algo.advantage in ("grpo", "dr_grpo", "rloo"):
        a = adv.broadcast_to_tokens(adv.group_advantages(algo.advantage, rewards, groups, algo.adv_eps), mask)
    elif algo.advantage in ("reinforce_pp", "reinforce_pp_baseline"):
        base = groups if algo.advantage == "reinforce_pp_baseline" else None
        a = adv.reinforce_pp_advantages(rewards, mask, kl, algo.kl_coef, algo.gamma, base)
    elif algo.advantage == "gae":
        if values is None:
            raise ValueError(f"algorithm '{algo.name}' uses GAE and needs critic values for every rollout")
        v = torch.from_numpy(pad_right(values, T))
        a, ret = adv.gae_advantages(adv.token_rewards(rewards, mask, kl, algo.kl_coef), v, mask, algo.gamma, algo.lam)
        returns = adv.to_numpy(ret)
    elif algo.advantage == "none":
        a = torch.zeros_like(mask)
    else:
        raise ValueError(f"unknown advantage estimator '{algo.advantage}'")
    if algo.whiten_advantages:
        a = adv.masked_whiten(a, mask)
    return adv.to_numpy(a), returns


def apply_overlong_penalty(rollouts: Sequence, algo: AlgorithmConfig) -> list:
    """DAPO soft overlong punishment added to each reward when ``algo.overlong_buffer > 0``."""
    if not algo.overlong_buffer:
        return list(rollouts)
    value = overlong_penalty(algo.max_completion_len, algo.overlong_buffer, algo.overlong_penalty)
    return [r._replace(reward=float(r.reward) + value(r.num_tokens)) for r in rollouts]


def make_batch(rollouts: Sequence, algo: AlgorithmConfig, pad_id: int, kl_fn: Optional[Callable] = None,
               values: Optional[Sequence[np.ndarray]] = None, pair_selector: Optional[Callable] = None,
               seed: int = 0) -> Batch:
    """Scored rollouts -> Batch: overlong filter and penalty, advantages, (pairs for online
    DPO), padding.

    For ``policy_loss == "online_dpo"`` the rows are (chosen, rejected) pairs, adjacent,
    with advantage +1 / -1 marking the role. Dynamic sampling is the driver's job (it
    needs to generate more); this function only batches what it is given.
    """
    check_rollouts(rollouts)
    rollouts = apply_overlong_penalty(rollouts, algo)
    if algo.filter_overlong:
        rollouts = overlong_filter(rollouts) or rollouts  # never empty the step entirely
    if algo.policy_loss == "online_dpo":
        selector = pair_selector or PAIR_SELECTORS.get(algo.pair_selection)
        if selector is None:
            raise ValueError(f"unknown pair selection '{algo.pair_selection}' ({sorted(PAIR_SELECTORS)})")
        pairs = select_pairs(rollouts, selector, seed)
        if not pairs:
            raise ValueError("online_dpo: no group has two rollouts with different rewards")
        rows = [r for pair in pairs for r in pair]
        T = max(len(r.completion_ids) for r in rows)
        sign = np.tile(np.array([1.0, -1.0], dtype=np.float32), len(pairs))[:, None]
        return collate(rows, np.broadcast_to(sign, (len(rows), T)).copy(), pad_id)
    a, returns = compute_advantages(rollouts, algo, kl_fn, values)
    T = a.shape[1]
    v = pad_right(values, T) if values is not None else None
    return collate(rollouts, a, pad_id, returns, v)


def rollout_metrics(batch: Batch) -> dict:
    """Flat, namespaced statistics of one step's batch (rewards, lengths, truncation)."""
    lengths = batch.loss_mask.sum(1)
    truncated = np.mean([r.finish_reason == "length" for r in batch.rollouts])
    return {"reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
            "reward/min": float(batch.rewards.min()), "reward/max": float(batch.rewards.max()),
            "response/len_mean": float(lengths.mean()), "response/len_max": float(lengths.max()),
            "response/truncated_frac": float(truncated), "batch/rows": float(batch.size),
            "batch/loss_tokens": float(batch.num_loss_tokens)}
