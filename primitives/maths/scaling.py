"""How many generator workers the next steps should have: a policy is a function
``policy(history, current) -> count`` of the run's logged metrics (``TrainState.metrics_history``,
one dict per step, oldest first) and the current count, called by the RL loop after every step.
The loop scales the workers when the count changes (``RayBackend.scale_generators``)."""
from __future__ import annotations

from typing import Callable, Sequence


def next_step(history: Sequence[dict]) -> int:
    """The step about to run: one after the last logged (a resumed run's history goes on)."""
    return int(history[-1]["step"]) + 1 if history else 0


def _mean(rows: Sequence[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if key in r]
    return sum(values) / len(values) if values else 0.0


def idle_scaling_policy(minimum: int, maximum: int, every: int = 5, threshold: float = 0.3) -> Callable:
    """Every ``every`` steps, one worker more or less by the idle shares of the last ``every``
    steps (``idle/trainers`` and ``idle/generators``: the share of a step each role sat idle;
    a step that itself changed the count, logging ``time/scale``, is left out):

    * grow (up to ``maximum``) when the trainers waited more than ``threshold`` of the time,
      and more than the generators did: generation is the bottleneck;
    * shrink (down to ``minimum``) when the generators waited more than ``threshold`` and more
      than the trainers, and the trainers would still wait at most ``threshold`` with one
      worker less (their wait scaled by ``n / (n - 1)``, as generation gets that much slower);
    * otherwise keep the count.

    In synchronous RL both roles wait while the other works, so the rule compares them: it
    adds workers while generation takes longer than training, and removes one only where
    that would not make the trainers wait past the threshold. A grow is never undone by the
    next decision, nor a shrink (no oscillation; the tests check this over random phase
    times)."""
    if not 1 <= minimum <= maximum:
        raise ValueError(f"idle_scaling_policy: need 1 <= minimum <= maximum, got {minimum} and {maximum}")
    if every < 1 or not 0.0 <= threshold < 1.0:
        raise ValueError(f"idle_scaling_policy: every must be >= 1 and threshold in [0, 1), got {every}, {threshold}")

    def policy(history: Sequence[dict], current: int) -> int:
        if not history or next_step(history) % every:
            return current
        window = [m for m in list(history)[-every:] if "time/scale" not in m]
        if not window:
            return current
        trainers, generators = _mean(window, "idle/trainers"), _mean(window, "idle/generators")
        if trainers > threshold and trainers > generators:
            return min(current + 1, maximum)
        if generators > threshold and generators > trainers and current > minimum \
                and trainers * current / (current - 1) <= threshold:
            return current - 1
        return min(max(current, minimum), maximum)

    policy.__qualname__ = f"idle_scaling_policy({minimum}, {maximum}, every={every}, threshold={threshold})"
    return policy


def step_scaling_policy(counts: Sequence[tuple]) -> Callable:
    """``[(step, count), ...]``: ``count`` workers from the given step on (a planned change, e.g.
    more generators once completions grow long); the first entry is the count at step 0."""
    counts = sorted(counts)
    if not counts or counts[0][0] != 0 or any(c < 1 for _, c in counts):
        raise ValueError(f"step_scaling_policy: the first entry must be step 0 and every count >= 1, got {counts}")

    def policy(history: Sequence[dict], current: int) -> int:
        step = next_step(history)
        return [c for s, c in counts if s <= step][-1]

    return policy
