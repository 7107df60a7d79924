"""The loss of one training (micro-)batch, composed from ``losses`` by an ``AlgorithmConfig``.

``policy_objective`` is what a trainer calls after recomputing ``logp`` with autograd;
``loss_fn(inputs) -> (loss, metrics)`` with the same inputs is the extension point that
replaces it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from primitives.hooks import with_traits
from primitives.maths import losses as L
from primitives.maths.kl import kl_k3


class LossInputs(NamedTuple):
    """Torch tensors of one micro-batch (B, T) plus the step's global counts."""

    logp: torch.Tensor  # current policy, with grad
    old_logp: Optional[torch.Tensor]  # the trainer's policy before this step's first update; None = logp.detach()
    advantages: torch.Tensor
    mask: torch.Tensor  # loss mask
    counts: L.LossCounts
    behaviour_logp: Optional[torch.Tensor] = None  # the generator's logprobs (capped IS weight, mismatch)
    ref_logp: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


def _mean(x, mask):
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def mismatch_metrics(old_logp, behaviour_logp, weights, capped, mask, share: float) -> dict:
    """How far the generator's logprobs are from the trainer's (architecture section 6), as shares.

    ``mismatch/k3`` estimates KL(generator || trainer) on the generator's samples;
    ``mismatch/max_abs_logp_diff`` is a maximum (it merges by max, not by sum)."""
    diff = (old_logp - behaviour_logp).detach() * mask
    return {"mismatch/k3": _mean(kl_k3(behaviour_logp.detach(), old_logp.detach(), mask), mask) * share,
            "mismatch/max_abs_logp_diff": float(diff.abs().max()) if mask.any() else 0.0,
            "mismatch/is_weight_mean": _mean(weights, mask) * share,
            "mismatch/is_clipped_frac": _mean(capped.float(), mask) * share}


# Policy losses: ``(logp, old_logp, advantages, mask, algo) -> (loss (B, T), clipped (B, T) bool)``.
def ppo_clip_policy_loss(logp, old_logp, advantages, mask, algo):
    """PPO's clipped surrogate per token, with ``algo``'s clip range and dual clip."""
    return L.ppo_clip_loss(logp, old_logp, advantages, algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip)


@with_traits(sequence_level=True)  # one ratio per sequence: seq-mean-token-mean, no token dual clip
def gspo_policy_loss(logp, old_logp, advantages, mask, algo):
    """GSPO's sequence-ratio surrogate on every token (aggregate with seq-mean-token-mean)."""
    return L.gspo_loss(logp, old_logp, advantages, mask, algo.clip_eps_low, algo.clip_eps_high)


POLICY_LOSS_FNS = {"ppo_clip": ppo_clip_policy_loss, "gspo": gspo_policy_loss}


def policy_objective(inputs: LossInputs, algo):
    """``(loss, metrics)``: ``algo.policy_loss_fn`` aggregated by ``algo.aggregation``, plus
    ``algo.kl_fn`` in the loss (unless KL goes in the reward) and the entropy bonus.

    The clip ratio is ``pi / pi_old`` with the trainer's own old logprobs (``logp.detach()``
    when the batch gets one update); the generator's logprobs enter only through the capped
    importance weight ``algo.is_level`` / ``algo.is_cap`` (architecture section 6).
    Metrics are sums over this micro-batch's tokens weighted to the step's global token
    count, so adding them over micro-batches and ranks gives step means.
    """
    x, mask = inputs, inputs.mask
    share = float(mask.sum()) / max(x.counts.num_tokens, 1)  # this micro-batch's share of tokens
    metrics = {}
    old = x.old_logp if x.old_logp is not None else x.logp.detach()
    per_tok, clipped = algo.policy_loss_fn(x.logp, old, x.advantages, mask, algo)
    if x.behaviour_logp is not None:
        level = algo.is_level if algo.is_level != "off" else "token"  # off: measured, not applied
        weights, capped = L.truncated_is_weights(old, x.behaviour_logp, mask, level, algo.is_cap)
        metrics.update(mismatch_metrics(old, x.behaviour_logp, weights, capped, mask, share))
        if algo.is_level != "off":
            per_tok = per_tok * weights
    pg = L.aggregate_loss(per_tok, mask, algo.aggregation, x.counts)
    loss = pg
    metrics["loss/policy"] = float(pg.detach())
    metrics["policy/clip_frac"] = _mean(clipped.float(), mask) * share
    metrics["policy/ratio_mean"] = _mean(torch.exp(x.logp - old).detach(), mask) * share
    metrics["policy/approx_kl_old"] = _mean(0.5 * (x.logp - old).detach() ** 2, mask) * share
    if algo.kl_coef and not algo.kl_in_reward:
        if x.ref_logp is None:
            raise ValueError(f"algorithm '{algo.name}' has kl_coef={algo.kl_coef} in the loss but no ref_logprobs")
        kl = algo.kl_fn(x.logp, x.ref_logp, mask)
        kl_term = L.aggregate_loss(kl, mask, algo.aggregation, x.counts)
        loss = loss + algo.kl_coef * kl_term
        metrics["loss/kl"] = float(kl_term.detach())
    if x.ref_logp is not None:
        metrics["kl/ref_k3"] = _mean(kl_k3(x.logp.detach(), x.ref_logp, mask), mask) * share
    if x.entropy is not None:
        metrics["policy/entropy"] = _mean(x.entropy.detach(), mask) * share
        if algo.entropy_coef:
            ent = L.aggregate_loss(L.entropy_bonus(x.entropy, mask), mask, algo.aggregation, x.counts)
            loss = loss + algo.entropy_coef * ent
            metrics["loss/entropy"] = float(ent.detach())
    metrics["loss/total"] = float(loss.detach())
    return loss, metrics


@with_traits(pairwise=True, needs_reference=True)
def online_dpo_objective(inputs: LossInputs, algo):
    """Online DPO over adjacent (chosen, rejected) rows (the pair selector's output);
    advantages mark the roles +1 / -1. ``-log sigmoid(algo.dpo_beta * margin)`` per pair,
    averaged over the step's pairs."""
    return _online_dpo(inputs, algo)


LOSS_FNS = {"policy": policy_objective, "online_dpo": online_dpo_objective}


def _online_dpo(x: LossInputs, algo):
    """Rows come as adjacent (chosen, rejected) pairs; advantages mark them +1 / -1."""
    if x.ref_logp is None:
        raise ValueError("online_dpo needs reference logprobs")
    seq = (x.logp * x.mask).sum(-1)
    ref = (x.ref_logp * x.mask).sum(-1)
    if seq.shape[0] % 2:
        raise ValueError("online_dpo: odd number of rows; pairs must stay together")
    loss_N, margin = L.online_dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], algo.dpo_beta)
    num_pairs = max(x.counts.num_sequences // 2, 1)  # every row of a DPO batch has loss tokens
    loss = loss_N.sum() / num_pairs
    share = seq.shape[0] / 2 / num_pairs
    metrics = {"loss/policy": float(loss.detach()), "loss/total": float(loss.detach()),
               "dpo/pairs": float(seq.shape[0] // 2), "dpo/margin": float(margin.mean()) * share,
               "dpo/accuracy": float((margin > 0).float().mean()) * share}
    if x.behaviour_logp is not None:  # measured, not applied: the DPO loss has no ratio to weight
        old = x.logp.detach()
        weights, capped = L.truncated_is_weights(old, x.behaviour_logp, x.mask, "token", algo.is_cap)
        token_share = float(x.mask.sum()) / max(x.counts.num_tokens, 1)
        metrics.update(mismatch_metrics(old, x.behaviour_logp, weights, capped, x.mask, token_share))
    return loss, metrics
