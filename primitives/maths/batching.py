"""From scored rollouts to the padded ``Batch`` one training step consumes (pure)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from primitives.hooks import call_hook, fn_name
from primitives.maths import advantages as adv
from primitives.maths.filters import select_pairs
from primitives.maths.shaping import overlong_penalty
from primitives.padding import pack_completions, pad_right
from primitives.types import Batch, BatchPlan, planned_rollouts

if TYPE_CHECKING:
    from primitives.maths.algorithms import AlgorithmConfig


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


def collate(rollouts: Sequence, advantages_BT: np.ndarray, pad_id: int, budget: int = 0,
            returns: Optional[np.ndarray] = None, values: Optional[np.ndarray] = None) -> Batch:
    """Pad rollouts into the Batch layout (prompts left, completions right)."""
    ids, attn, P, T = pack_completions([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], pad_id)
    loss_mask = pad_right([r.loss_mask for r in rollouts], T)
    has_ref = all(r.ref_logprobs is not None for r in rollouts)
    return Batch(
        rollouts=tuple(rollouts), input_ids=ids, attention_mask=attn, prompt_len=P,
        loss_mask=loss_mask, behaviour_logprobs=pad_right([r.logprobs for r in rollouts], T),
        rewards=np.asarray([r.reward for r in rollouts], dtype=np.float32),
        advantages=(advantages_BT[:, :T] * loss_mask).astype(np.float32),
        ref_logprobs=pad_right([r.ref_logprobs for r in rollouts], T) if has_ref else None,
        returns=returns, values=values, budget=int(budget),
    )


def compute_advantages(rollouts: Sequence, algo: "AlgorithmConfig", values: Optional[Sequence[np.ndarray]] = None):
    """``(advantages (B, T), returns (B, T) or None)`` numpy: ``algo.advantage_fn`` on the
    rollouts' rewards, with ``algo.kl_fn`` of the generator's and the reference's logprobs when
    KL goes in the reward, then batch whitening if ``algo.whiten_advantages``."""
    T = max(1, max(len(r.completion_ids) for r in rollouts))
    mask = torch.from_numpy(pad_right([r.loss_mask for r in rollouts], T))
    kl = None
    if algo.kl_in_reward and algo.kl_coef:
        if any(r.ref_logprobs is None for r in rollouts):
            raise ValueError(f"algorithm '{algo.name}' puts KL in the reward but rollouts lack ref_logprobs")
        kl = algo.kl_fn(torch.from_numpy(pad_right([r.logprobs for r in rollouts], T)),
                        torch.from_numpy(pad_right([r.ref_logprobs for r in rollouts], T)), mask)
    inputs = adv.AdvantageInputs(rewards=torch.tensor([r.reward for r in rollouts], dtype=torch.float32),
                                 groups=tuple(r.group for r in rollouts), mask=mask, token_kl=kl,
                                 values=None if values is None else torch.from_numpy(pad_right(values, T)))
    out = call_hook(algo.advantage_fn, "advantage_fn", inputs, algo)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"advantage_fn {fn_name(algo.advantage_fn)} must return (advantages (B, T), returns or "
                         f"None), got {type(out).__name__}")
    a, returns = out
    if tuple(a.shape) != tuple(mask.shape):
        raise ValueError(f"advantage_fn {fn_name(algo.advantage_fn)} returned advantages of shape "
                         f"{tuple(a.shape)}; expected (B, T) = {tuple(mask.shape)}")
    if algo.whiten_advantages:
        a = adv.masked_whiten(a, mask)
    return adv.to_numpy(a * mask), None if returns is None else adv.to_numpy(returns)


def overlong_limit(algo: "AlgorithmConfig", budget: int) -> int:
    """The overlong penalty's hard limit: ``algo.max_completion_len``, else the generation budget."""
    limit = algo.max_completion_len or budget
    if limit <= 0:
        raise ValueError(f"algorithm '{algo.name}': the overlong penalty needs the generation budget; pass "
                         "budget=GenerationConfig.max_new_tokens to make_batch")
    return limit


def apply_overlong_penalty(rollouts: Sequence, algo: "AlgorithmConfig", budget: int = 0) -> list:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13) added to each reward when
    ``algo.overlong_buffer_frac > 0``; the buffer is that share of the hard limit. Length is
    counted in policy tokens (tool output inside a completion does not count); for multi-turn
    rollouts ``budget`` is the whole rollout's (the RL loop passes ``max_new_tokens`` x ``max_turns``:
    ``cluster.loop.train.policy_token_budget``), not a turn's."""
    if not algo.overlong_buffer_frac:
        return list(rollouts)
    limit = overlong_limit(algo, budget)
    value = overlong_penalty(limit, max(1, round(algo.overlong_buffer_frac * limit)), algo.overlong_penalty)
    return [r._replace(reward=float(r.reward) + value(int(r.loss_mask.sum()))) for r in rollouts]


def mask_truncated(batch: Batch) -> Batch:
    """DAPO overlong filtering: completions cut off by the length limit keep their place in
    the group statistics but get no loss (loss mask and advantages 0 on their row)."""
    keep = np.asarray([r.finish_reason != "length" for r in batch.rollouts], dtype=np.float32)[:, None]
    return batch._replace(loss_mask=batch.loss_mask * keep, advantages=batch.advantages * keep)


def make_batch(rollouts: Sequence, algo: "AlgorithmConfig", pad_id: int,
               values: Optional[Sequence[np.ndarray]] = None, seed: int = 0, budget: int = 0) -> Batch:
    """Scored rollouts -> Batch: overlong penalty, advantages (``algo.advantage_fn``), or pairs
    (``algo.pair_selector``) for a pairwise loss, padding, overlong filtering (truncated rows
    masked; for a pairwise loss, never paired).

    ``budget`` is the generation budget the rollouts were sampled with
    (``GenerationConfig.max_new_tokens``, times ``max_turns`` for multi-turn tool rollouts:
    the most policy tokens a rollout can hold): Dr.GRPO's constant normaliser and the default
    limit of DAPO's overlong penalty. ``values`` are the critic's per rollout (GAE). With a
    pair selector the rows are (chosen, rejected) pairs, adjacent, with advantage +1 / -1
    marking the role. Rollout filters (dynamic sampling) are the driver's job (it needs to
    generate more); this function only batches what it is given. Nothing to batch (no
    rollouts, or no pair) is an error here; ``trainable_batch`` returns None instead.
    """
    batch = trainable_batch(rollouts, algo, pad_id, values, seed, budget)
    if batch is None:
        check_rollouts(rollouts)  # no rollouts: named as such
        raise ValueError(f"algorithm '{algo.name}': the pair selector {fn_name(algo.pair_selector)} found no "
                         "pair (no group has two rollouts with different rewards)")
    return batch


def trainable_batch(rollouts: Sequence, algo: "AlgorithmConfig", pad_id: int,
                    values: Optional[Sequence[np.ndarray]] = None, seed: int = 0,
                    budget: int = 0) -> Optional[Batch]:
    """``make_batch`` of one RL step, or None when the step has nothing to train: no rollouts
    (the filters kept no group: with dynamic sampling, every group's rewards tied), or, for a
    pairwise loss, no pair (online DPO with every group tied). The driver then skips the
    update rather than stopping the run."""
    if not rollouts:
        return None
    check_rollouts(rollouts)
    rollouts = apply_overlong_penalty(rollouts, algo, budget)
    if algo.pair_selector is not None:
        if algo.filter_overlong:  # a pair needs both rows: truncated completions are never paired
            rollouts = [r for r in rollouts if r.finish_reason != "length"]
        pairs = select_pairs(rollouts, algo.pair_selector, seed)
        if not pairs:
            return None
        rows = [r for pair in pairs for r in pair]
        T = max(len(r.completion_ids) for r in rows)
        sign = np.tile(np.array([1.0, -1.0], dtype=np.float32), len(pairs))[:, None]
        return collate(rows, np.broadcast_to(sign, (len(rows), T)).copy(), pad_id, budget)
    a, returns = compute_advantages(rollouts, algo, values)
    v = pad_right(values, a.shape[1]) if values is not None else None
    batch = collate(rollouts, a, pad_id, budget, returns, v)
    return mask_truncated(batch) if algo.filter_overlong else batch


def planned_batch(plan: BatchPlan, parts: Sequence, algo: "AlgorithmConfig",
                  values: Optional[Sequence[np.ndarray]] = None) -> Optional[Batch]:
    """``trainable_batch`` of the plan's rollouts: what every rank of a step builds for itself
    (the same on each), None when there is nothing to train."""
    return trainable_batch(planned_rollouts(plan, parts), algo, plan.pad_token_id, values, plan.seed, plan.budget)


def rollout_metrics(batch: Batch, component_names: Optional[Sequence[str]] = None) -> dict:
    """Flat, namespaced statistics of one step's batch (rewards, lengths, truncation).

    When every rollout carries a ``reward_vector`` (K,), also ``reward/<name>``: the batch
    mean of each component, named by ``component_names`` (``build_reward``'s third value;
    default ``component_0`` ...).
    """
    lengths = batch.loss_mask.sum(1)
    truncated = np.mean([r.finish_reason == "length" for r in batch.rollouts])
    metrics = {"reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std()),
               "reward/min": float(batch.rewards.min()), "reward/max": float(batch.rewards.max()),
               "response/len_mean": float(lengths.mean()), "response/len_max": float(lengths.max()),
               "response/truncated_frac": float(truncated), "batch/rows": float(batch.size),
               "batch/loss_tokens": float(batch.num_loss_tokens)}
    vectors = [r.reward_vector for r in batch.rollouts]
    if not vectors or any(v is None for v in vectors):
        return metrics
    means_K = np.stack(vectors).astype(np.float64).mean(0)  # (K,)
    names = list(component_names) if component_names is not None else [f"component_{k}" for k in range(len(means_K))]
    if len(names) != len(means_K):
        raise ValueError(f"rollouts carry {len(means_K)} reward components, {len(names)} names given: {names}")
    keys = [f"reward/{name}" for name in names]
    if len(set(keys)) != len(keys) or set(keys) & set(metrics):
        raise ValueError(f"reward component names {names} repeat or clash with {sorted(metrics)}")
    return {**metrics, **{k: float(m) for k, m in zip(keys, means_K)}}
