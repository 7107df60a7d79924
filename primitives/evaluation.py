"""Held-out evaluation: greedy decoding scored by a reward function."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from primitives.generation import generate_rollouts
from primitives.rewards import score_rollouts
from primitives.types import GenerationConfig


def greedy_accuracy(model, tokenizer, items: Sequence, reward_fn: Callable, max_new_tokens: int,
                    batch_size: int = 256, correct: float = 1.0, stop=()) -> float:
    """Share of ``items`` whose greedy completion earns ``reward_fn == correct``."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, n=1, stop=tuple(stop))
    rollouts = generate_rollouts(model, tokenizer, list(items), config, batch_size=batch_size)
    rewards = np.asarray([r.reward for r in score_rollouts(rollouts, reward_fn)])
    return float(np.mean(rewards >= correct))
