"""The seeds' maths and algorithm-config names (seeds/000 and 001), as their readers call them:
KL of sequences, reward normalisation, the per-algorithm config makers, a KL schedule, and the
loss functions whose seed shapes repeat a known error (refused at the call, naming the form that
works). Each delegates to the project's primitives (``primitives.maths``).

The seeds' two documents call the same names with different inputs: seeds/000 passes one
rollout's logprobs as lists and gets a float, seeds/001 passes ``[batch, seq_len]`` tensors and a
mask and gets one value per sequence. Both work here.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from primitives.maths import advantages as adv
from primitives.maths.kl import sequence_forward_kl, sequence_reverse_kl
from rl_primitives.api import DAPO_AS_PAIRWISE, SeedAlgorithmConfig, create_algorithm_config


def _as_rows(logprobs, ref_logprobs, valid_mask) -> tuple:
    """``(logp (B, T), ref (B, T), mask (B, T), one)``: ``one`` when a single sequence came as
    a list or a 1-d array/tensor (the seeds/000 shape), whose answer is then a float."""
    logp = torch.as_tensor(np.asarray(logprobs, dtype=np.float32)) if not torch.is_tensor(logprobs) else logprobs
    ref = torch.as_tensor(np.asarray(ref_logprobs, dtype=np.float32)) \
        if not torch.is_tensor(ref_logprobs) else ref_logprobs
    if logp.shape != ref.shape:
        raise ValueError(f"logprobs {tuple(logp.shape)} and ref_logprobs {tuple(ref.shape)} differ in shape: the "
                         "reference must score the same tokens the policy sampled (seeds README error 3)")
    one = logp.dim() == 1
    mask = torch.ones_like(logp) if valid_mask is None else \
        torch.as_tensor(np.asarray(valid_mask) if not torch.is_tensor(valid_mask) else valid_mask).to(logp)
    if mask.shape != logp.shape:
        raise ValueError(f"valid_mask {tuple(mask.shape)} and logprobs {tuple(logp.shape)} differ in shape: one mask "
                         "value per token")
    if one:
        logp, ref, mask = logp[None], ref[None], mask.reshape(1, -1)
    return logp.float(), ref.float(), mask.float(), one


def _kl(direction: Callable, logprobs, ref_logprobs, valid_mask, kl_fn: Optional[Callable], swap: bool = False):
    if kl_fn is not None:  # the user's own computation, called as each seed document calls it
        if valid_mask is None:  # seeds/000: kl_fn(p, q) = KL(p || q), so the reverse direction swaps them
            return kl_fn(ref_logprobs, logprobs) if swap else kl_fn(logprobs, ref_logprobs)
        return kl_fn(logprobs, ref_logprobs, valid_mask)  # seeds/001: the same order, kl_fn knows its direction
    logp, ref, mask, one = _as_rows(logprobs, ref_logprobs, valid_mask)
    out = direction(logp, ref, mask)
    return float(out[0]) if one else out


def compute_forward_kl(logprobs, ref_logprobs, valid_mask=None, kl_fn: Optional[Callable] = None):
    """The seeds' "forward" KL, KL(policy || ref), of each sequence sampled from the policy: the
    sum over its (masked) tokens of Schulman's k3, ``r - 1 - log r`` with ``r = ref / policy``
    (``primitives.maths.kl.sequence_reverse_kl``; the RL literature calls this direction
    "reverse"). Not the seeds' ``exp(lp) * (lp - ref_lp)``, which estimates nothing (seeds
    README error 2). A list or 1-d sequence gives a float, ``[B, T]`` tensors (and mask) give
    ``[B]``; ``kl_fn(logprobs, ref_logprobs[, valid_mask])`` replaces the computation."""
    return _kl(sequence_reverse_kl, logprobs, ref_logprobs, valid_mask, kl_fn)


def compute_reverse_kl(logprobs, ref_logprobs, valid_mask=None, kl_fn: Optional[Callable] = None):
    """The seeds' "reverse" direction, KL(ref || policy), estimated on tokens the policy sampled by
    importance weighting: with ``rho = ref / policy`` per token, ``rho log rho - rho + 1``
    (``primitives.maths.kl.sequence_forward_kl``), summed over the masked tokens - the per-token
    divergences along the policy's own prefixes (the whole sequence's KL(ref || policy) would need
    prefixes sampled from the reference). Not the forward KL with its arguments swapped: the tokens
    were sampled from the policy. Shapes as ``compute_forward_kl``; ``kl_fn`` is called as each seed
    calls it: seeds/000's ``kl_fn(ref_logprobs, logprobs)`` (lists), seeds/001's
    ``kl_fn(policy_logprobs, ref_logprobs, valid_mask)``."""
    return _kl(sequence_forward_kl, logprobs, ref_logprobs, valid_mask, kl_fn, swap=True)


def compute_kl(logprobs, ref_logprobs, kl_fn: Optional[Callable] = None, valid_mask=None):
    """The seeds' ``compute_kl(logprobs, ref_logprobs, kl_fn=...)`` (seeds/001): KL(policy || ref) of
    each sequence, the sum over its (masked) tokens of ``kl_fn(logp, ref_logp, mask)``, a per-token
    KL function of ours (``create_truncated_kl(1.0)``, ``create_confidence_masked_kl(0.1)``,
    ``primitives.maths.kl.get_kl_fn('k1')``; Schulman's k3 without one). A function that returns one
    value per sequence (``(B,)``) is taken as it is. A list or 1-d sequence gives a float, ``[B, T]``
    a ``[B]`` tensor. Anything else (the seeds' float-list ``truncated_kl``) is refused by name."""
    from primitives.hooks import fn_name
    from primitives.maths.kl import get_kl_fn

    logp, ref, mask, one = _as_rows(logprobs, ref_logprobs, valid_mask)
    fn = kl_fn if kl_fn is not None else get_kl_fn("k3")
    try:
        out = fn(logp, ref, mask)
    except Exception as e:
        raise ValueError(f"compute_kl: kl_fn {fn_name(fn)} failed on [B, T] tensors ({type(e).__name__}: {e}); the "
                         "documented signature is kl_fn(logp, ref_logp, mask) -> (B, T), e.g. create_truncated_kl("
                         "1.0), not the seeds' truncated_kl of float lists (seeds README error 2)") from None
    shape = tuple(getattr(out, "shape", ()))
    if shape == tuple(logp.shape):
        out = (out * (mask > 0)).sum(-1)  # our kl_fns weight by the mask already: keep, do not weight twice
    elif shape != tuple(logp.shape[:1]):
        got = f"shape {shape}" if hasattr(out, "shape") else type(out).__name__
        raise ValueError(f"compute_kl: kl_fn {fn_name(fn)} returned {got} for "
                         f"{tuple(logp.shape)} logprobs; it must return per-token (B, T) or per-sequence (B,) values")
    return float(out[0]) if one else out


def compute_batch_kl(batch, kl_fn: Optional[Callable] = None) -> list:
    """One KL(policy || ref) per rollout of ``batch`` (a ``RolloutBatch`` or rollouts), over its
    loss tokens (tool output masked out): ``kl_fn(logprobs, ref_logprobs)`` of each, or
    ``compute_forward_kl``. Each rollout needs ``ref_logprobs`` of its own tokens
    (``create_rollout(..., ref_model=...)``)."""
    rollouts = getattr(batch, "rollouts", batch)
    out = []
    for r in rollouts:
        if r.ref_logprobs is None:
            raise ValueError(f"compute_batch_kl: rollout {r.uid} has no ref_logprobs; make the rollouts with "
                             "create_rollout(..., ref_model=ref_model) or create_batch_rollouts(..., ref_model=...)")
        keep = np.asarray(r.loss_mask) > 0
        lp, ref = np.asarray(r.logprobs)[keep], np.asarray(r.ref_logprobs)[keep]
        out.append(float(kl_fn(lp, ref)) if kl_fn is not None else compute_forward_kl(lp, ref))
    return out


def normalize_rewards(rewards: Sequence[float], normalizer: Optional[Callable] = None, eps: float = 1e-8) -> list:
    """The seeds' ``normalize_rewards(rewards, normalizer)``: ``normalizer(rewards)``, or, without
    one, the z-score over the batch ``(r - mean) / (std + eps)`` (population std; all equal: all
    0). For advantages within each prompt's group use ``compute_grpo_advantages``."""
    if normalizer is not None:
        return list(normalizer(list(rewards)))
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return []
    if not np.isfinite(r).all():
        raise ValueError(f"normalize_rewards: rewards must be finite, got {r.tolist()[:8]}")
    return ((r - r.mean()) / (r.std() + eps)).tolist()


def create_kl_schedule(initial_kl: float = 0.1, final_kl: float = 0.01, num_iterations: int = 100) -> Callable:
    """``kl_coef_fn(iteration)``: ``initial_kl`` at 0 falling linearly to ``final_kl`` at
    ``num_iterations`` and staying there (the seeds' version kept going, below zero after twice
    the iterations: a negative KL coefficient rewards moving away from the reference)."""
    if num_iterations < 1:
        raise ValueError(f"create_kl_schedule: num_iterations must be >= 1, got {num_iterations}")
    if initial_kl < 0 or final_kl < 0:
        raise ValueError(f"create_kl_schedule: KL coefficients must be >= 0, got {initial_kl} -> {final_kl}")

    def kl_coef_fn(iteration: int) -> float:
        progress = min(max(iteration / num_iterations, 0.0), 1.0)
        return initial_kl + (final_kl - initial_kl) * progress

    return kl_coef_fn


def create_grpo_config(kl_coef: float = 0.1, normalize_advantages: bool = True) -> SeedAlgorithmConfig:
    """GRPO (``create_algorithm_config('grpo', {'kl_coef': kl_coef})``); without
    ``normalize_advantages`` the group's rewards are centred but not divided by their std
    (Dr. GRPO's advantage, ``primitives.maths.advantages.dr_grpo_advantage``)."""
    params: dict = {"kl_coef": kl_coef}
    if not normalize_advantages:
        params["advantage_fn"] = adv.dr_grpo_advantage
    return create_algorithm_config("grpo", params)


def create_ppo_config(clip_range: float = 0.2, value_loss_coef: Optional[float] = None,
                      kl_coef: float = 0.0) -> SeedAlgorithmConfig:
    """PPO with a critic (``create_algorithm_config('ppo', ...)``), per-token ratios clipped at
    ``1 +- clip_range`` (not a sequence's summed ratio: seeds README error 5). The critic is a
    model of its own with its own optimizer, so there is no shared loss for ``value_loss_coef``
    to weight: giving one is refused (set the critic's learning rate instead)."""
    if value_loss_coef is not None:
        raise ValueError(f"create_ppo_config(value_loss_coef={value_loss_coef}): the critic here is its own model "
                         "with its own optimizer (no shared value head), so no loss sum to weight; set the critic's "
                         "learning rate (a job's algorithm.critic_lr) instead")
    return create_algorithm_config("ppo", {"clip_epsilon": clip_range, "kl_coef": kl_coef})


def create_dapo_config(beta: float = 0.1, normalize_advantages: bool = True):
    """Refused: the seeds' "DAPO" config is the pairwise (DPO-style) loss (seeds README error 4)."""
    raise ValueError(f"create_dapo_config(beta={beta}): " + DAPO_AS_PAIRWISE.format(given="beta"))


def get_algorithm_config(iteration: int, switch_strategy: Callable[[int], str]) -> SeedAlgorithmConfig:
    """The config of the algorithm ``switch_strategy(iteration)`` names ("grpo", "ppo", ...),
    with its preset's defaults (``create_algorithm_config``). For a schedule the loop follows
    step by step, pass ``train(algorithm_schedule=...)`` or ``piecewise_schedule``."""
    name = switch_strategy(iteration)
    if not isinstance(name, str):
        raise TypeError(f"get_algorithm_config: switch_strategy({iteration}) returned {name!r}, not an algorithm name")
    return create_algorithm_config(name)


def get_algorithm_for_iteration(iteration: int, switch_strategy: Optional[Callable[[int], str]] = None):
    """The seeds' ``get_algorithm_for_iteration(iteration)`` (seeds/003): ``get_algorithm_config``,
    which needs the schedule it reads - the seeds call it without one, and no schedule is right
    for every run, so that is refused naming the form."""
    if switch_strategy is None:
        raise TypeError(f"get_algorithm_for_iteration({iteration}): which algorithm an iteration runs is the caller's "
                        "schedule; pass it: get_algorithm_for_iteration(iteration, lambda i: 'grpo' if i < 50 else "
                        "'ppo'), or give train(...) algorithm_schedule=piecewise_schedule(...) to switch mid-training")
    return get_algorithm_config(iteration, switch_strategy)


def _reference_helper(name: str, form: str):
    def refused(*args, **kwargs):
        raise TypeError(f"{name}(...) is a helper of the seeds' update_fn(ref, policy) examples, a shape that "
                        f"changes the reference in place out of the loop's sight (seeds README 9); here a reference "
                        f"update is ref_update_fn(ref_state, policy_weights, step, kl) -> ref_state: {form}")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: the seeds' ``{name}``; use {form}."
    return refused


create_ema_model = _reference_helper("create_ema_model", "create_ref_update_fn('ema', decay=0.999)")
copy_params = _reference_helper("copy_params", "create_ref_update_fn('periodic', reset_every=1) (the policy's "
                                "weights every step)")
reset_if_needed = _reference_helper("reset_if_needed", "create_ref_update_fn('periodic', reset_every=N)")


_LOSS_FROM_ROLLOUTS = ("{name}: the seeds' shape builds the loss from the rollouts' stored logprobs (floats from "
                       "sampling), which carry no gradient to the model (seeds README error 1{extra}). Recompute the "
                       "logprobs with the model and use {form}, or let training_step(model, optimizer, batch, "
                       "create_algorithm_config({algo!r})) do it")


def compute_ppo_loss(*args, **kwargs):
    """Refused: built from the rollouts' logprobs (no gradient) and, in seeds/000, from summed
    sequence ratios (seeds README errors 1 and 5)."""
    raise TypeError(_LOSS_FROM_ROLLOUTS.format(
        name="compute_ppo_loss", extra="; and PPO clips per-token ratios, not a sequence's summed ratio: error 5",
        form="primitives.maths.losses.ppo_clip_loss(logp, old_logp, advantages, eps_low, eps_high)", algo="ppo"))


def compute_policy_gradient_loss(*args, **kwargs):
    """Refused: built from the rollouts' logprobs, which carry no gradient (seeds README error 1)."""
    raise TypeError(_LOSS_FROM_ROLLOUTS.format(
        name="compute_policy_gradient_loss", extra="",
        form="-(logp * advantages * mask).sum() / mask.sum() on "
             "logp = primitives.model.logprobs.completion_logprobs(model, ...)",
        algo="reinforce"))


def compute_reinforce_loss(*args, **kwargs):
    """Refused: built from the rollouts' logprobs, which carry no gradient (seeds README error 1)."""
    raise TypeError(_LOSS_FROM_ROLLOUTS.format(
        name="compute_reinforce_loss", extra="; a constant baseline is create_algorithm_config('reinforce', "
        "{'baseline': b})", form="the 'reinforce' preset", algo="reinforce"))


def compute_dapo_loss(*args, **kwargs):
    """Refused: the seeds' "DAPO" loss is the pairwise DPO loss (seeds README error 4), built
    from the rollouts' logprobs (error 1)."""
    raise TypeError("compute_dapo_loss: " + DAPO_AS_PAIRWISE.format(given="pairs") +
                    "; the loss itself is primitives.maths.losses.online_dpo_loss(chosen_logp, rejected_logp, "
                    "ref_chosen_logp, ref_rejected_logp, beta) on logprobs the model recomputes (error 1)")


def compute_loss_by_algorithm(batch, algorithm_config, **kwargs):
    """Refused: the seeds' dispatch builds each algorithm's loss from the rollouts' stored logprobs
    (seeds README error 1), and its "dapo" branch is the pairwise loss (error 4)."""
    name = algorithm_config.get("algorithm") if isinstance(algorithm_config, dict) else \
        getattr(algorithm_config, "algorithm", algorithm_config)
    raise TypeError(_LOSS_FROM_ROLLOUTS.format(
        name=f"compute_loss_by_algorithm(batch, {{'algorithm': {name!r}, ...}})",
        extra="; its 'dapo' is the pairwise DPO loss, online_dpo here: error 4",
        form="the algorithm's preset (create_algorithm_config(name, params)), which dispatches every loss",
        algo=str(name)))


def compute_dapo_pairs(batch, pair_selector: Optional[Callable] = None) -> list:
    """The seeds' ``compute_dapo_pairs(batch, pair_selector)``: ``pair_selector(batch)``, checked to
    be ``(preferred, dispreferred)`` rollout pairs of one prompt each. Without a selector, the highest-
    against the lowest-reward rollout of each prompt's group (``top_bottom_pairs``), as online DPO
    pairs them (the seeds' "DAPO" is that pairwise loss: README error 4)."""
    from primitives.maths.filters import by_group, top_bottom_pairs

    rollouts = list(getattr(batch, "rollouts", batch))
    if pair_selector is None:
        return [pair for members in by_group(rollouts).values() for pair in top_bottom_pairs(members)]
    pairs = list(pair_selector(batch))
    for k, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"compute_dapo_pairs: pair_selector's item {k} is {type(pair).__name__}, not a "
                            f"(preferred, dispreferred) pair of rollouts")
        if pair[0].group != pair[1].group:
            raise ValueError(f"compute_dapo_pairs: pair {k} joins rollouts of prompts {pair[0].group} and "
                             f"{pair[1].group}; a preference pair answers one prompt")
    return pairs

