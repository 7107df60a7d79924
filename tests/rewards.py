"""Reward functions the Ray tests give their reward workers, in a module of their own.

A reward worker imports the module that defines its reward function (cloudpickle sends a module's
function by name). Defined in a test module, that import brought torch, transformers and the
cluster code into every reward worker, about 4 s of CPU each; this module imports numpy and the
arithmetic task alone. Each reward varies with the sampled tokens, so a random model's groups
have spread and a step moves the weights: a random tiny model never gets a sum right."""
from primitives.fixtures.tasks import arithmetic_reward


def spread_reward(rollout) -> float:
    """The sampled tokens' sum, mod 3: 0, 1 or 2."""
    return float(int(rollout.completion_ids.sum()) % 3)


def spread_plus_exact(rollout) -> float:
    """``spread_reward`` plus exact match on the sum."""
    return spread_reward(rollout) + arithmetic_reward(rollout)


def spread_and_exact(rollout) -> list:
    """A vector reward: ``spread_reward`` and exact match, as two components."""
    return [spread_reward(rollout), arithmetic_reward(rollout)]


def spread5_reward(rollout) -> float:
    """The sampled tokens' sum mod 5, over 4 (0 to 1 in quarters): groups rarely tie."""
    return float(int(rollout.completion_ids.sum()) % 5) / 4.0


def parity_reward(rollout) -> float:
    """The sampled tokens' sum, mod 2."""
    return float(int(rollout.completion_ids.sum()) % 2)
