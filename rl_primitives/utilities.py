"""The seeds' debugging helpers (seeds/003 "Debugging Tips"): ``inspect_rollout``,
``validate_batch`` and ``plot_training_curves``, over our records."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from primitives.io.evaluation import render_prompt_text
from primitives.io.loggers import plot_curves
from primitives.types import Rollout, RolloutBatch


def _summary(value, width: int = 8) -> str:
    """An array as its shape, dtype, a few values and (numbers) min / mean / max."""
    a = np.asarray(value)
    if a.size == 0:
        return f"array{a.shape} {a.dtype} (empty)"
    head = np.array2string(a.ravel()[:width], precision=4, separator=", ", threshold=width)
    more = f" ... (+{a.size - width})" if a.size > width else ""
    stats = ""
    if np.issubdtype(a.dtype, np.number):
        stats = f"  min {a.min():.4g} mean {a.mean():.4g} max {a.max():.4g}"
    return f"array{a.shape} {a.dtype} {head}{more}{stats}"


def _text(value, limit: int) -> str:
    s = str(value)
    return repr(s if len(s) <= limit else s[:limit] + f"... (+{len(s) - limit} chars)")


def format_rollout(rollout: Rollout, text_limit: int = 400) -> str:
    """Every field of ``rollout``, one a line: text shown (cut at ``text_limit`` characters),
    arrays summarised (shape, dtype, first values, min/mean/max), tool calls and results
    listed, and the policy-trained share of the completion."""
    lines = [f"Rollout {rollout.uid} (group {rollout.group}, policy version {rollout.policy_version})"]
    for name, value in zip(rollout._fields, rollout):
        if name in ("uid", "group", "policy_version"):
            continue
        if name == "prompt":
            shown = _text(render_prompt_text(value) if not isinstance(value, str) else value, text_limit)
        elif name == "text":
            shown = _text(value, text_limit)
        elif isinstance(value, np.ndarray):
            shown = _summary(value)
        elif name in ("tool_calls", "tool_results"):
            shown = f"{len(value)}" + "".join(f"\n      {i}: {tuple(v)!r}"[: text_limit + 12] for i, v in
                                              enumerate(value))
        elif name == "metadata" and value:
            shown = ", ".join(f"{k}={_text(v, 80) if not isinstance(v, (int, float)) else v}"
                              for k, v in value.items())
        else:
            shown = repr(value)
        lines.append(f"  {name:15s} {shown}")
    mask = np.asarray(rollout.loss_mask)
    lines.append(f"  {'(trained)':15s} {int(mask.sum())} of {rollout.num_tokens} completion tokens in the loss")
    return "\n".join(lines)


def inspect_rollout(rollout: Rollout, text_limit: int = 400, write: Callable[[str], None] = print) -> str:
    """Pretty-print every field of ``rollout`` (``format_rollout``); returns the text."""
    out = format_rollout(rollout, text_limit)
    write(out)
    return out


def rollout_problems(r: Rollout) -> list:
    """What is wrong with one rollout, for training: lengths that disagree, an empty prompt, a
    missing or non-finite reward, non-finite or positive logprobs."""
    T = len(r.completion_ids)
    problems = [f"{name} has length {len(getattr(r, name))}, completion_ids has {T}"
                for name in ("loss_mask", "logprobs") + (("ref_logprobs",) if r.ref_logprobs is not None else ())
                if len(getattr(r, name)) != T]
    if len(r.prompt_ids) == 0:
        problems.append("empty prompt_ids")
    if r.reward is None or not np.isfinite(r.reward):
        problems.append(f"reward is {r.reward!r}; expected a finite float")
    lp = np.asarray(r.logprobs, dtype=np.float64)
    if lp.size and (not np.all(np.isfinite(lp)) or np.any(lp > 1e-6)):
        problems.append("logprobs are not all finite and <= 0")
    return problems


def validate_batch(batch, group_size: Optional[int] = None) -> dict:
    """The seeds' report on a batch (a ``RolloutBatch``, our ``Batch`` or a list of rollouts):
    ``{"is_valid", "num_rollouts", "invalid_rollouts": [{"uid", "problems"}], "duplicate_uids",
    "groups": {group: size}, "problems"}``. Batch-level problems: repeated uids (rollouts of
    different prompts made one at a time share index 0), and groups smaller than 2 or, with
    ``group_size``, of another size."""
    rollouts: Sequence[Rollout] = batch.rollouts if isinstance(batch, tuple) and hasattr(batch, "rollouts") \
        else list(batch)
    invalid = [{"uid": r.uid, "problems": p} for r in rollouts for p in [rollout_problems(r)] if p]
    seen: set = set()
    duplicates: list = []
    groups: dict = {}
    for r in rollouts:
        if r.uid in seen:
            duplicates.append(r.uid)
        seen.add(r.uid)
        groups[r.group] = groups.get(r.group, 0) + 1
    problems = []
    if not rollouts:
        problems.append("no rollouts")
    if duplicates:
        problems.append(f"repeated uids {sorted(set(duplicates))[:5]}: each prompt needs its own index")
    small = sorted(g for g, k in groups.items() if k < 2)
    if small:
        problems.append(f"groups of one rollout {small[:5]}: group-relative advantages need GenerationConfig.n >= 2")
    if group_size is not None:
        odd = sorted(g for g, k in groups.items() if k != group_size)
        if odd:
            problems.append(f"groups {odd[:5]} do not have {group_size} rollouts")
    return {"is_valid": not invalid and not problems, "num_rollouts": len(rollouts), "invalid_rollouts": invalid,
            "duplicate_uids": sorted(set(duplicates)), "groups": groups, "problems": problems}


STATS_KEYS = ("loss", "rewards_mean", "rewards_std", "kl_divergence", "grad_norm", "learning_rate")
METRIC_KEYS = ("loss/total", "reward/mean", "reward/std", "kl/ref_k3", "grad_norm", "lr")


def plot_training_curves(history: Sequence, save_path: str = "training_curves.png",
                         keys: Optional[Sequence[str]] = None, title: str = "training curves") -> str:
    """The seeds' ``plot_training_curves(final_state.stats_history, save_path=...)``: one panel
    per statistic over the iterations (``primitives.io.loggers.plot_curves``). ``history`` is
    the seeds' ``TrainingStats`` list or our ``TrainState.metrics_history`` (metric dicts)."""
    rows = []
    for i, h in enumerate(history):
        if isinstance(h, dict):
            rows.append({"step": h.get("step", i), **{k: v for k, v in h.items() if isinstance(v, (int, float))}})
        elif hasattr(h, "_asdict"):
            rows.append({"step": i, **{k: v for k, v in h._asdict().items() if isinstance(v, (int, float))
                                       and np.isfinite(v)}})
        else:
            raise ValueError(f"plot_training_curves: entry {i} is {type(h).__name__}; expected TrainingStats or a "
                             f"metrics dict")
    if keys is None:
        keys = STATS_KEYS if any(k in row for row in rows for k in STATS_KEYS) else METRIC_KEYS
    return plot_curves(rows, list(keys), save_path, title)


__all__ = ["inspect_rollout", "format_rollout", "validate_batch", "plot_training_curves", "RolloutBatch"]
