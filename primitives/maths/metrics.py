"""Merging metric dicts: over micro-batches and trainer ranks, then over optimizer updates.

Every metric a loss reports is one of three kinds, told by its key:

* a **share** (the default): this part's contribution to the step's value. Losses are
  already divided by the step's global token / sequence counts, and rates (clip fraction,
  entropy, KL) are reported as ``local rate * local tokens / global tokens`` - that is, a
  rate weighted by its count. Shares add.
* a **maximum** or **minimum**: keys whose last part is ``max`` / ``min``, or starts with
  ``max_`` / ``min_``, or ends with ``_max`` / ``_min`` (``mismatch/max_abs_logp_diff``,
  ``response/len_max``, ``reward/max``). They take the max / min.
* a **global** value that every rank already holds whole (``grad_norm`` and ``lr`` after
  DeepSpeed's reduction; the critic's ``critic/grad_norm`` and ``critic/lr`` likewise).
  The first part's value is kept.

A dict comprehension over ranks keeps the last rank's share (1/world_size of the truth);
``merge_metrics`` is the one place that knows how to combine them (STYLE.md point 15).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

GLOBAL_KEYS = ("grad_norm", "lr", "critic/grad_norm", "critic/lr")


def reduction(key: str) -> str:
    """``"sum"``, ``"max"``, ``"min"`` or ``"first"``: how parts of metric ``key`` combine."""
    if key in GLOBAL_KEYS:
        return "first"
    last = key.rsplit("/", 1)[-1]
    for kind in ("max", "min"):
        if last == kind or last.startswith(kind + "_") or last.endswith("_" + kind):
            return kind
    return "sum"


def merge_metrics(parts: Sequence[dict]) -> dict:
    """One dict from dicts that are parts of the same step (micro-batches, ranks).

    A key missing from a part (a rank with no rows this step) simply has no share there.
    """
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = float(value)
                continue
            kind = reduction(key)
            if kind == "sum":
                out[key] += float(value)
            elif kind == "max":
                out[key] = max(out[key], float(value))
            elif kind == "min":
                out[key] = min(out[key], float(value))
    return out


def mean_over_updates(updates: Sequence[dict]) -> dict:
    """One dict for a rollout batch trained in several optimizer updates (PPO epochs x
    mini-batches): each update's value is whole, so values are averaged (maxima and minima
    still take the max / min), and ``policy/updates`` says how many there were."""
    if not updates:
        return {}
    out: dict = {}
    for key in dict.fromkeys(k for u in updates for k in u):
        values = [float(u[key]) for u in updates if key in u]
        kind = reduction(key)
        out[key] = max(values) if kind == "max" else min(values) if kind == "min" else sum(values) / len(values)
    out["policy/updates"] = float(len(updates))
    return out


def merge_rank_updates(per_rank: Sequence[Sequence[dict]]) -> tuple:
    """``(summary, updates)`` from each rank's list of per-update dicts: the ranks' shares
    are merged update by update, then the updates are averaged. Ranks must report the same
    number of updates (they step together)."""
    lengths = {len(u) for u in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"trainer ranks reported different numbers of optimizer updates: {sorted(lengths)}")
    updates = [merge_metrics(parts) for parts in zip(*per_rank)]
    return mean_over_updates(updates), updates


def stale_groups(rollouts: Sequence, version: int, max_staleness: int) -> set:
    """Groups with a rollout more than ``max_staleness`` policy versions behind ``version``."""
    return {r.group for r in rollouts if version - r.policy_version > max_staleness}


def staleness_metrics(rollouts: Sequence, version: int) -> dict:
    """``staleness/mean`` and ``staleness/max`` (policy versions between each rollout's
    generator and the policy it trains), and the share of rollouts at each lag
    (``staleness/lag_<k>``)."""
    lags = np.array([version - r.policy_version for r in rollouts], dtype=np.int64)
    if not len(lags):
        return {}
    out = {"staleness/mean": float(lags.mean()), "staleness/max": float(lags.max())}
    out.update({f"staleness/lag_{k}": float(np.mean(lags == k)) for k in range(int(lags.max()) + 1)})
    return out


def tool_metrics(summaries: Sequence) -> dict:
    """Tool statistics of a step from its rollouts' summaries (``primitives.types.summarize``):
    ``tools/calls_per_rollout``, ``tools/success_rate`` (share of executed calls whose result is
    not an error; 0 when none ran), ``tools/rollouts_with_calls`` (share of rollouts that
    called a tool) and ``tools/untrained_tokens`` (completion tokens per rollout outside the
    loss: the tools' output, which the policy did not sample)."""
    n, results = max(len(summaries), 1), sum(s.tool_results for s in summaries)
    return {"tools/calls_per_rollout": sum(s.tool_calls for s in summaries) / n,
            "tools/success_rate": (results - sum(s.tool_errors for s in summaries)) / results if results else 0.0,
            "tools/rollouts_with_calls": sum(s.tool_calls > 0 for s in summaries) / n,
            "tools/untrained_tokens": sum(s.untrained_tokens for s in summaries) / n}
