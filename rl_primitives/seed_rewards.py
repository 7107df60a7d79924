"""The seeds' reward composers (seeds/003, "Compose Functions"): ``combine_rewards`` of
``length_reward`` and ``keyword_reward``, over this project's reward primitives
(``primitives.env.rewards``). The seeds give no definition of ``safety_check_reward``; a word
list is not a safety check, so it is refused naming what to pass instead."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from primitives.env.rewards import compute_vector_reward, weighted_sum_aggregator
from primitives.hooks import fn_name


def combine_rewards(*reward_fns: Callable, weights: Optional[Sequence[float]] = None) -> Callable:
    """One ``reward_fn(rollout) -> float``: the weighted sum of ``reward_fns``' rewards (weights 1
    without ``weights``). Each component must give a finite number; an error names it. For the
    components logged one by one, pass them as a vector instead: ``train(reward_fn=vector_reward_fn(
    f, g), aggregate_fn=weighted_sum_aggregator([...]))``."""
    if not reward_fns or not all(callable(f) for f in reward_fns):
        raise TypeError(f"combine_rewards(*reward_fns, weights=...) takes reward functions rollout -> float, got "
                        f"{[type(f).__name__ for f in reward_fns] or 'none'}")
    w = [1.0] * len(reward_fns) if weights is None else [float(x) for x in weights]
    if len(w) != len(reward_fns) or not all(math.isfinite(x) for x in w):
        raise ValueError(f"combine_rewards: {len(reward_fns)} reward functions need as many finite weights, got {w}")
    aggregate = weighted_sum_aggregator(w)

    def reward_fn(rollout) -> float:
        return aggregate(compute_vector_reward(rollout, reward_fns))

    names = [getattr(f, "__qualname__", None) or fn_name(f) for f in reward_fns]
    reward_fn.__qualname__ = "combine_rewards(" + ", ".join(f"{x:g}*{n}" for x, n in zip(w, names)) + ")"
    return reward_fn


def length_reward(min_length: int = 0, max_length: Optional[int] = None, reward: float = 1.0) -> Callable:
    """``reward`` when the completion's text has between ``min_length`` and ``max_length`` characters
    (the seeds count characters: ``len(rollout.generation.text)``), else 0. In tokens:
    ``primitives.env.rewards.length_window_reward``."""
    if min_length < 0 or (max_length is not None and max_length < min_length):
        raise ValueError(f"length_reward: the window [{min_length}, {max_length}] is empty or negative")

    def reward_fn(rollout) -> float:
        n = len(rollout.text)
        return reward if n >= min_length and (max_length is None or n <= max_length) else 0.0

    reward_fn.__qualname__ = f"length_reward({min_length}, {max_length})"
    return reward_fn


def safety_check_reward(*args, **kwargs):
    """Refused: the seeds name it without a definition, and no built-in list of words is a safety check."""
    raise TypeError("safety_check_reward(): the seeds never define it, and a built-in list of words would pass for a "
                    "safety check it is not; pass your safety scorer as a reward: a classifier through "
                    "create_rm_reward_fn(load_reward_model(path), tokenizer), a service through "
                    "primitives.env.rewards.create_http_reward_fn(url), or your own reward_fn(rollout) -> float")
