"""Rollout filters and pair selectors (pure functions over lists of Rollouts)."""
from __future__ import annotations

import random
from typing import Callable, Sequence


def by_group(rollouts: Sequence) -> dict:
    """Rollouts grouped by prompt, in first-seen order: ``{group: [rollouts]}``."""
    out: dict = {}
    for r in rollouts:
        out.setdefault(r.group, []).append(r)
    return out


def _reward(r) -> float:
    if r.reward is None:
        raise ValueError(f"rollout {r.uid} has no reward yet; score rollouts before filtering")
    return float(r.reward)


def dynamic_sampling_filter(rollouts: Sequence, tol: float = 0.0) -> list:
    """DAPO dynamic sampling: drop every group whose rewards are all equal (within ``tol``);
    such groups have zero advantage and only dilute the gradient."""
    kept = []
    for members in by_group(rollouts).values():
        rewards = [_reward(r) for r in members]
        if max(rewards) - min(rewards) > tol:
            kept.extend(members)
    return kept


def apply_filters(rollouts: Sequence, filters: Sequence[Callable]) -> list:
    """``rollouts`` through each filter in turn (an algorithm's ``filters``); a filter that
    raises names itself."""
    from primitives.hooks import call_hook

    kept = list(rollouts)
    for f in filters:
        kept = list(call_hook(f, "filter", kept))
    return kept


def kept_indices(rollouts: Sequence, filters: Sequence[Callable]) -> list:
    """Positions in ``rollouts`` of the ones ``apply_filters`` keeps, in the order it keeps them
    (found by uid: a filter selects rollouts, it does not rewrite them)."""
    where = {r.uid: i for i, r in enumerate(rollouts)}
    return [where[r.uid] for r in apply_filters(rollouts, filters)]


def overlong_filter(rollouts: Sequence) -> list:
    """Drop completions cut off by the length limit (``finish_reason == "length"``)."""
    return [r for r in rollouts if r.finish_reason != "length"]


def top_bottom_pairs(members: Sequence, rng=None) -> list:
    """One pair per group: the highest- vs the lowest-reward rollout (none if they tie)."""
    ranked = sorted(members, key=_reward)
    if len(ranked) < 2 or _reward(ranked[-1]) == _reward(ranked[0]):
        return []
    return [(ranked[-1], ranked[0])]


def all_pairs(members: Sequence, rng=None) -> list:
    """Every (better, worse) pair with strictly different rewards."""
    return [(a, b) for a in members for b in members if _reward(a) > _reward(b)]


def create_random_pairs(num_pairs: int = 1, seed: int = 0) -> Callable:
    """Selector of up to ``num_pairs`` random strictly-ordered pairs per group, seeded."""

    def random_pairs(members: Sequence, rng=None) -> list:
        rng = rng or random.Random(seed)
        candidates = all_pairs(members)
        return rng.sample(candidates, min(num_pairs, len(candidates)))

    return random_pairs


PAIR_SELECTORS = {"top_bottom": top_bottom_pairs, "all_pairs": all_pairs, "random": create_random_pairs()}


def select_pairs(rollouts: Sequence, selector: Callable = top_bottom_pairs, seed: int = 0) -> list:
    """``pair_selector`` applied group by group: a list of (chosen, rejected) rollouts."""
    rng = random.Random(seed)
    pairs = []
    for members in by_group(rollouts).values():
        pairs.extend(selector(members, rng))
    return pairs
