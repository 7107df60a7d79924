"""Policy, value, preference and SFT losses as functions of tensors.

Per-token losses are (B, T); ``aggregate_loss`` turns them into a scalar. Every aggregation
divides by a *global* count (tokens or sequences of the whole step across all data-parallel
ranks), passed in by the caller, so that the sum of the ranks' losses equals the loss of
the unsharded batch (as in OpenRLHF's ``test_loss_aggregation``).

Sources: PPO clip - Schulman et al. 2017 (arXiv 1707.06347); clip-higher and token-mean -
DAPO, Yu et al. 2025 (arXiv 2503.14476); dual clip - Ye et al. 2020 (arXiv 1912.09729);
GSPO - Zheng et al. 2025 (arXiv 2507.18071); Dr.GRPO's constant normaliser - Liu et al.
2025 (arXiv 2503.20783); DPO - Rafailov et al. 2023 (arXiv 2305.18290); truncated
importance sampling against the generator - Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training" (fengyao.notion.site/off-policy-rl).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from primitives.maths.kl import per_token_kl


class LossCounts(NamedTuple):
    """Global denominators of one optimizer step (over all ranks and micro-batches)."""

    num_tokens: int  # loss tokens in the whole step
    num_sequences: int  # sequences in the whole step
    max_len: int = 0  # seq-mean-token-sum-norm's constant: the generation budget (tokens)
    num_rows: int = 0  # rows in the whole step, before sharding (every rank pads to the largest shard's passes)


# Aggregations: ``(loss (B, T), mask (B, T), counts) -> scalar``; the algorithm record holds one.
def token_mean(loss_BT: torch.Tensor, mask: torch.Tensor, counts: LossCounts) -> torch.Tensor:
    """Sum over all loss tokens / the step's global token count (DAPO)."""
    return (loss_BT * mask).sum() / max(counts.num_tokens, 1)


def seq_mean_token_mean(loss_BT: torch.Tensor, mask: torch.Tensor, counts: LossCounts) -> torch.Tensor:
    """Each sequence's token mean, summed / the step's global sequence count (GRPO)."""
    per_seq = (loss_BT * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / max(counts.num_sequences, 1)


def seq_mean_token_sum_norm(loss_BT: torch.Tensor, mask: torch.Tensor, counts: LossCounts) -> torch.Tensor:
    """Token sum / (global sequence count * generation budget) (Dr.GRPO)."""
    # Dr.GRPO divides by a constant, the generation budget, never this step's padded width
    if counts.max_len <= 0:
        raise ValueError("seq-mean-token-sum-norm divides by the generation budget: pass "
                         "budget=GenerationConfig.max_new_tokens to make_batch (LossCounts.max_len is 0)")
    return (loss_BT * mask).sum() / (max(counts.num_sequences, 1) * counts.max_len)


AGGREGATIONS = {"token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
                "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


def aggregate_loss(loss_BT: torch.Tensor, mask: torch.Tensor, mode, counts: LossCounts) -> torch.Tensor:
    """Scalar loss from per-token losses; ``mode`` is an aggregation function or its name
    (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``)."""
    if loss_BT.shape != mask.shape:
        raise ValueError(f"loss {tuple(loss_BT.shape)} and mask {tuple(mask.shape)} differ in shape")
    if isinstance(mode, str):
        if mode not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation '{mode}' (choose from {', '.join(AGGREGATIONS)})")
        mode = AGGREGATIONS[mode]
    return mode(loss_BT, mask, counts)


def ppo_clip_loss(logp, old_logp, advantages, eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip: Optional[float] = None):
    """Per-token clipped surrogate ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``.

    With ``dual_clip = c > 1``, negative-advantage tokens are further bounded by ``-c A``.
    Returns ``(loss (B, T), clipped (B, T) bool)``.
    """
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped_obj = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_obj)
    was_clipped = clipped_obj > unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


IS_LEVELS = ("off", "token", "sequence")


def truncated_is_weights(old_logp, behaviour_logp, mask, level: str = "token", cap: float = 2.0):
    """Capped importance weights of the trainer's policy over the generator's (no gradient).

    ``token``: ``w_t = min(exp(old_t - behaviour_t), cap)``; ``sequence``: one weight per
    row, ``min(exp(sum_t mask_t (old_t - behaviour_t)), cap)``, on every token. The loss of
    each token is multiplied by ``w``, so samples the generator over-drew are down-weighted
    and the truncation bounds the variance. Returns ``(w (B, T), capped (B, T) bool)``;
    both are 0 / False where ``mask`` is 0.

    Both logprobs are of the full tempered distribution ``softmax(logits / T)``, also when the
    generator sampled with top-k / top-p (``primitives.model.generation``): with equal weights
    ``w`` is 1, so it measures the gap between the policies, not the truncation.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"importance-sampling level must be token or sequence, got '{level}'")
    if cap <= 0:
        raise ValueError(f"importance-sampling cap must be positive, got {cap}")
    log_ratio = ((old_logp - behaviour_logp) * mask).detach()
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    raw = torch.exp(log_ratio.clamp(max=20.0))
    return raw.clamp(max=cap) * mask, (raw > cap) & (mask > 0)


def gspo_loss(logp, old_logp, advantages, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO: one importance ratio per sequence, ``s = exp(mean_t (logp - old_logp))``, clipped.

    The token form of the paper: every token carries ``sg[s] * pi_t / sg[pi_t]`` so the
    gradient is the sequence's; the per-token loss is the sequence loss on every valid token
    (aggregate with seq-mean-token-mean). Returns ``(loss (B, T), clipped (B, T) bool)``.
    """
    n = mask.sum(-1).clamp(min=1)
    log_s = ((logp - old_logp) * mask).sum(-1) / n  # (B,)
    s_tok = torch.exp((log_s.detach()[:, None] + logp - logp.detach()).clamp(-20.0, 20.0))  # (B, T)
    adv = advantages
    unclipped = -adv * s_tok
    clipped_obj = -adv * s_tok.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_obj)
    return loss * mask, (clipped_obj > unclipped) & (mask > 0)


def kl_penalty(logp, ref_logp, mask, estimator: str = "k3"):
    """Per-token KL(pi || ref) term for the loss (GRPO puts ``kl_coef * kl`` in the loss). (B, T)"""
    return per_token_kl(logp, ref_logp, mask, estimator)


def entropy_bonus(entropy, mask):
    """Per-token negative entropy: adding ``coef * this`` to the loss rewards exploration. (B, T)"""
    return -entropy * mask


def clipped_value_loss(values, old_values, returns, mask, clip: float = 0.2):
    """PPO value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = old_V + clip(V - old_V, -clip, clip)``. (B, T)"""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2) * mask


def online_dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta: float = 0.1):
    """Pairwise preference loss ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``.

    Inputs are summed sequence logprobs of each pair's chosen/rejected completion, (N,).
    Returns ``(loss (N,), reward_margin (N,))``.
    """
    margin = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    return -F.logsigmoid(beta * margin), beta * margin.detach()


def sft_loss(logp, mask, num_tokens: Optional[int] = None):
    """Masked negative log-likelihood, mean over loss tokens (global count if given). Scalar."""
    if logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and mask {tuple(mask.shape)} differ in shape")
    denom = num_tokens if num_tokens is not None else int(mask.sum().item())
    return -(logp * mask).sum() / max(denom, 1)
