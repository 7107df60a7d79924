"""RewardWorker: runs user reward code (and optionally a reward model) away from the trainers.

Without a reward model it never imports torch (a second of CPU at every start-up on a small
machine): the rollouts arrive as numpy, and the built-in rewards are plain Python.

A raising or non-finite reward function fails the step with the rollout uid and the
function's name in the message (``primitives.env.rewards.RewardError``).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from primitives.env.rewards import create_rm_reward_fn, load_reward_model, score_rollouts
from primitives.maths.filters import kept_indices
from primitives.types import BatchPlan, planned_rollouts, summarize
from rl_actors.common import actor_info, planned_inputs, setup_process
from rl_actors.reuse import Reusable


class RewardWorker(Reusable):
    """Scores rollouts with the job's reward function (and reward model). Kept for the next job
    like the other roles (``cluster.ray_wing.pool``): its start imports Ray and the module of the
    reward function, a second or two of CPU, more when that module brings torch."""

    role = "reward"

    def __init__(self, reward_fn: Optional[Callable] = None, aggregate_fn: Optional[Callable] = None,
                 shaping_fn: Optional[Callable] = None, reward_model_path: Optional[str] = None,
                 rank: int = 0, num_threads: int = 1):
        setup_process(num_threads, needs_torch=reward_model_path is not None)
        if reward_fn is None and reward_model_path is None:
            raise ValueError(f"reward {rank}: give a reward_fn, a reward_model_path, or both")
        self.rank = rank
        fns = []
        if reward_fn is not None:
            fns.append(reward_fn)
        if reward_model_path is not None:
            model, tok = load_reward_model(reward_model_path)
            fns.append(create_rm_reward_fn(model, tok))
        if len(fns) == 2 and aggregate_fn is None:
            raise ValueError(f"reward {rank}: a reward function and a reward model give a vector; pass aggregate_fn")
        self.reward_fn = fns[0] if len(fns) == 1 else (lambda r, fs=tuple(fns): [f(r) for f in fs])
        self.aggregate_fn, self.shaping_fn = aggregate_fn, shaping_fn

    def info(self) -> dict:
        """Where it runs, and whether torch is loaded (plain-Python rewards never load it)."""
        return {**actor_info(self.role, self.rank), "torch_loaded": "torch" in sys.modules}

    def score(self, rollouts: Sequence, shaped: bool = True) -> list:
        """The rollouts with their rewards; ``shaped`` False: the task's reward, without the shaping
        function (an evaluation's)."""
        return score_rollouts(list(rollouts), self.reward_fn, self.aggregate_fn, self.shaping_fn if shaped else None)

    def score_summarized(self, rollouts: Sequence, shaped: bool = True) -> tuple:
        """``(summaries, scored rollouts)``: the driver fetches the summaries and leaves the
        rollouts in the object store (called with two returns)."""
        scored = self.score(rollouts, shaped)
        return [summarize(r) for r in scored], scored

    def select(self, filters: Sequence[Callable], rows: tuple, num_parts: int, *resolved) -> list:
        """Positions in ``rows`` (``BatchPlan`` rows over the parts that follow) of the rollouts
        an algorithm's ``filters`` keep, in their order: the filters run here, beside the
        rollouts, and only the positions go back to the driver."""
        parts, _ = planned_inputs(num_parts, resolved)
        return kept_indices(planned_rollouts(BatchPlan(rows, 0), parts), filters)
