"""Advantage estimators. Rewards are per rollout (B,); ``groups`` names each rollout's prompt.

Sources: GRPO - Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), eq. for outcome
supervision; Dr.GRPO - Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv
2503.20783), no std normalisation; RLOO - Ahmadian et al. 2024 (arXiv 2402.14740),
leave-one-out baseline; REINFORCE with a constant baseline - Williams 1992 (Machine Learning
8, "Simple statistical gradient-following algorithms"); REINFORCE++ - Hu 2025 (arXiv
2501.03262), token-level KL in the reward, discounted returns, global batch normalisation;
GAE - Schulman et al. 2016 (arXiv 1506.02438).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch


def check_rewards(rewards: torch.Tensor, where: str = "rewards") -> None:
    bad = ~torch.isfinite(rewards)
    if bad.any():
        i = int(torch.nonzero(bad).flatten()[0])
        raise ValueError(f"{where}: non-finite reward {rewards[i].item()} at position {i}")


def group_index(groups: Sequence) -> tuple:
    """``(index (B,) int64, num_groups)``: index[i] numbers the group of rollout i."""
    ids: dict = {}
    index = torch.tensor([ids.setdefault(g, len(ids)) for g in groups], dtype=torch.long)
    return index, len(ids)


def _group_stats(rewards: torch.Tensor, groups: Sequence, min_size: int, name: str):
    if rewards.ndim != 1 or len(groups) != rewards.shape[0]:
        raise ValueError(f"{name}: rewards {tuple(rewards.shape)} and {len(groups)} group ids do not match")
    check_rewards(rewards, name)
    index, n = group_index(groups)
    counts = torch.zeros(n, dtype=rewards.dtype).index_add_(0, index, torch.ones_like(rewards))
    if counts.min() < min_size:
        g = [g for g in dict.fromkeys(groups)][int(counts.argmin())]
        raise ValueError(f"{name}: group '{g}' has {int(counts.min())} rollout(s); this estimator "
                         f"needs at least {min_size} per prompt (set GenerationConfig.n >= {min_size})")
    sums = torch.zeros(n, dtype=rewards.dtype).index_add_(0, index, rewards)
    mean = sums / counts
    return index, counts, mean


def grpo_advantages(rewards: torch.Tensor, groups: Sequence, eps: float = 1e-6) -> torch.Tensor:
    """``(R - mean_G) / (std_G + eps)`` with the unbiased group std (as TRL). (B,) -> (B,)"""
    index, counts, mean = _group_stats(rewards, groups, 2, "grpo_advantages")
    centred = rewards - mean[index]
    var = torch.zeros_like(mean).index_add_(0, index, centred ** 2) / (counts - 1)
    return centred / (var.sqrt()[index] + eps)


def dr_grpo_advantages(rewards: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """Dr.GRPO: ``R - mean_G`` (no std division, which biases toward easy/hard prompts). (B,)"""
    index, _, mean = _group_stats(rewards, groups, 2, "dr_grpo_advantages")
    return rewards - mean[index]


def rloo_advantages(rewards: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """RLOO: ``R_i - mean_{j != i} R_j = G/(G-1) * (R_i - mean_G)``. (B,)"""
    index, counts, mean = _group_stats(rewards, groups, 2, "rloo_advantages")
    g = counts[index]
    return (rewards - mean[index]) * g / (g - 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True):
    """Normalise ``x`` to zero mean, unit (population) std over positions where mask is 1.
    Padding stays 0. (B, T) -> (B, T)"""
    if mask.sum() == 0:
        raise ValueError("masked_whiten: mask selects no positions")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def broadcast_to_tokens(values_B: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value on every loss token. (B,), (B, T) -> (B, T)"""
    return values_B[:, None].to(mask.dtype) * mask


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where mask is 1, per row. (B, T) -> (B,)"""
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(-1).values.clamp(min=0)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token reward: ``-kl_coef * kl_t`` on every token, plus R on the last one. (B, T)"""
    r = torch.zeros_like(mask, dtype=torch.float32)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl * mask
    last = last_token_index(mask)
    return r.index_put((torch.arange(len(rewards)), last), rewards.float(), accumulate=True) * mask


def discounted_returns(token_r: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` where t' is the next policy token (mask 1) after t.

    Masked positions inside a completion (tool output in a multi-turn rollout) are skipped,
    not terminals: the return flows across them undiscounted, so tokens before a tool call
    still see the outcome reward. Right padding carries nothing. (B, T) -> (B, T)"""
    out = torch.zeros_like(token_r)
    running = torch.zeros(token_r.shape[0], dtype=token_r.dtype)
    for t in reversed(range(token_r.shape[1])):
        running = torch.where(mask[:, t] > 0, token_r[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                            kl_coef: float = 0.0, gamma: float = 1.0,
                            groups: Optional[Sequence] = None) -> torch.Tensor:
    """REINFORCE++: discounted token returns (KL in the reward), whitened over the whole batch.

    With ``groups`` it is the "baseline" variant: the group mean reward is subtracted first.
    (B,), (B, T) -> (B, T)
    """
    check_rewards(rewards, "reinforce_pp_advantages")
    if groups is not None:
        rewards = dr_grpo_advantages(rewards, groups)
    returns = discounted_returns(token_rewards(rewards, mask, kl, kl_coef), mask, gamma)
    return masked_whiten(returns, mask)


def gae_advantages(token_r: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over right-padded rows, batched over B.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (V past the last token is 0),
    ``A_t = delta_t + gamma * lam * A_{t+1}``, where t+1 is the next policy token: masked
    positions inside a completion (tool output) are skipped, not terminals, and padding after
    the last token passes on nothing. Returns ``(advantages, returns = A + V)`` (B, T).
    """
    if not (token_r.shape == values.shape == mask.shape):
        raise ValueError(f"gae: rewards {tuple(token_r.shape)}, values {tuple(values.shape)}, "
                         f"mask {tuple(mask.shape)} must match")
    B, T = token_r.shape
    adv = torch.zeros_like(token_r)
    next_value = torch.zeros(B, dtype=token_r.dtype)
    next_adv = torch.zeros(B, dtype=token_r.dtype)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_r[:, t] + gamma * next_value - values[:, t]
        a = (delta + gamma * lam * next_adv) * m
        adv[:, t] = a
        # a masked position is skipped: the next policy token's value and advantage pass through
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, a, next_adv)
    return adv, (adv + values) * mask


class AdvantageInputs(NamedTuple):
    """What an ``advantage_fn(inputs, algo) -> (advantages (B, T), returns (B, T) or None)`` sees.

    ``token_kl`` is ``algo.kl_fn`` of the generator's and the reference's logprobs when the
    algorithm puts KL in the reward (``algo.kl_in_reward`` and ``kl_coef > 0``), else None;
    the estimator decides how it enters (subtracted from the sequence reward before group
    statistics, or as a per-token reward). ``values`` are the critic's, for GAE."""

    rewards: torch.Tensor  # (B,) float32 sequence rewards (aggregated, shaped, overlong penalty)
    groups: tuple  # B group ids: rollouts answering the same prompt share one
    mask: torch.Tensor  # (B, T) float32 loss mask (1 on policy tokens)
    token_kl: Optional[torch.Tensor] = None  # (B, T) float32 per-token KL estimate, 0 off the mask
    values: Optional[torch.Tensor] = None  # (B, T) float32 critic values V_t


def _sequence_rewards(x: AdvantageInputs, kl_coef: float) -> torch.Tensor:
    """Rewards with the sequence's KL subtracted (KL in the reward, group estimators)."""
    return x.rewards if x.token_kl is None else x.rewards - kl_coef * x.token_kl.sum(-1)


def grpo_advantage(x: AdvantageInputs, algo):
    """GRPO: ``(R - mean_G) / (std_G + algo.adv_eps)`` on every loss token."""
    return broadcast_to_tokens(grpo_advantages(_sequence_rewards(x, algo.kl_coef), x.groups, algo.adv_eps),
                               x.mask), None


def dr_grpo_advantage(x: AdvantageInputs, algo):
    """Dr.GRPO: ``R - mean_G`` on every loss token."""
    return broadcast_to_tokens(dr_grpo_advantages(_sequence_rewards(x, algo.kl_coef), x.groups), x.mask), None


def rloo_advantage(x: AdvantageInputs, algo):
    """RLOO: ``R_i - mean_{j != i} R_j`` on every loss token."""
    return broadcast_to_tokens(rloo_advantages(_sequence_rewards(x, algo.kl_coef), x.groups), x.mask), None


def reinforce_pp_advantage(x: AdvantageInputs, algo):
    """REINFORCE++: discounted token returns with the KL as a per-token reward, whitened."""
    return reinforce_pp_advantages(x.rewards, x.mask, x.token_kl, algo.kl_coef, algo.gamma), None


def reinforce_pp_baseline_advantage(x: AdvantageInputs, algo):
    """REINFORCE++ with the group mean reward subtracted first (critic-free baseline)."""
    return reinforce_pp_advantages(x.rewards, x.mask, x.token_kl, algo.kl_coef, algo.gamma, x.groups), None


def gae_advantage(x: AdvantageInputs, algo):
    """PPO: GAE over token rewards (KL per token, R on the last) and the critic's values;
    returns ``(advantages, returns)``, the returns being the value loss's targets."""
    if x.values is None:
        raise ValueError("gae_advantage needs critic values for every rollout (build the job with a critic)")
    return gae_advantages(token_rewards(x.rewards, x.mask, x.token_kl, algo.kl_coef), x.values, x.mask,
                          algo.gamma, algo.lam)


gae_advantage.needs_values = True  # type: ignore[attr-defined]  # a hooks trait: the driver asks the critic


def no_advantage(x: AdvantageInputs, algo):
    """Zeros: for losses that do not use advantages (online DPO marks pair roles itself)."""
    return torch.zeros_like(x.mask), None


def constant_baseline(baseline: float = 0.0):
    """REINFORCE with a fixed baseline (the seeds' ``compute_advantages(rewards, baseline)``):
    ``R - baseline`` on every loss token, the sequence's KL subtracted first when it is in the
    reward. No group statistics, so it learns from one completion per prompt; the variance is
    what a fixed baseline leaves (a group or a critic removes more)."""
    b = float(baseline)
    if not np.isfinite(b):
        raise ValueError(f"constant_baseline: baseline must be finite, got {baseline}")

    def advantage(x: AdvantageInputs, algo):
        check_rewards(x.rewards, "constant_baseline")
        return broadcast_to_tokens(_sequence_rewards(x, algo.kl_coef) - b, x.mask), None

    advantage.__name__ = f"constant_baseline({b:g})"
    advantage.__qualname__ = advantage.__name__
    advantage.baseline = b  # type: ignore[attr-defined]
    return advantage


# a trait the loop checks before any generation: these compare completions of one prompt, so a
# run must sample at least this many per prompt (GenerationConfig.n, a job's generation.group_size)
for _fn in (grpo_advantage, dr_grpo_advantage, rloo_advantage, reinforce_pp_baseline_advantage):
    _fn.min_group_size = 2  # type: ignore[attr-defined]

ADVANTAGE_FNS = {"grpo": grpo_advantage, "dr_grpo": dr_grpo_advantage, "rloo": rloo_advantage,
                 "reinforce_pp": reinforce_pp_advantage, "reinforce_pp_baseline": reinforce_pp_baseline_advantage,
                 "gae": gae_advantage, "none": no_advantage}


def to_numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy().astype(np.float32)
