"""Held-out evaluation: pass@k, evaluation metrics of scored rollouts, readable sample records.

``greedy_accuracy`` runs in one process; on Ray, ``cluster.loop.train.evaluate`` samples and
scores on the actors and calls ``eval_metrics`` and ``sample_records`` here.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np

from primitives.env.rewards import score_rollouts
from primitives.io.checkpoint import atomic_file
from primitives.model.generation import generate_rollouts
from primitives.types import Conversation, GenerationConfig


def greedy_accuracy(model, tokenizer, items: Sequence, reward_fn: Callable, max_new_tokens: int,
                    batch_size: int = 256, correct: float = 1.0, stop=()) -> float:
    """Share of ``items`` whose greedy completion earns ``reward_fn == correct``, decoded ``batch_size``
    rows at a time at most."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, n=1, stop=tuple(stop),
                              max_batch_rows=batch_size or 0)
    rollouts = generate_rollouts(model, tokenizer, list(items), config)
    rewards = np.asarray([r.reward for r in score_rollouts(rollouts, reward_fn)])
    return float(np.mean(rewards >= correct))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples:
    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, arXiv 2107.03374, eq. 1).

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, the paper's numerically stable
    form: no large binomial coefficients."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per problem), got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c} correct of n={n} samples")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_samples_P: Sequence[int], num_correct_P: Sequence[int], k: int) -> float:
    """pass@k averaged over P problems (each with its own sample count)."""
    if len(num_samples_P) != len(num_correct_P) or not len(num_samples_P):
        raise ValueError(f"mean_pass_at_k needs one sample count and one correct count per problem, got "
                         f"{len(num_samples_P)} and {len(num_correct_P)}")
    return float(np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(num_samples_P, num_correct_P)]))


def _check_scored(rollouts: Sequence) -> None:
    if not rollouts:
        raise ValueError("evaluation got no rollouts")
    unscored = [r.uid for r in rollouts if r.reward is None]
    if unscored:
        raise ValueError(f"evaluation needs scored rollouts; {len(unscored)} have no reward, e.g. {unscored[0]}")
    uids = [r.uid for r in rollouts]
    if len(set(uids)) != len(uids):
        dupe = next(u for u in uids if uids.count(u) > 1)
        raise ValueError(f"rollout uid {dupe} appears twice: give the evaluation items distinct (epoch, index)")


def _component_names(vector_K, component_names: Optional[Sequence[str]]) -> list:
    """``component_names``, or ``component_<k>`` as ``rollout_metrics`` names them."""
    K = len(vector_K)
    names = list(component_names) if component_names is not None else [f"component_{k}" for k in range(K)]
    if len(names) != K or len(set(names)) != K:
        raise ValueError(f"rollouts carry {K} reward components; {len(names)} names given: {names} "
                         "(give one distinct name per component)")
    return names


def eval_metrics(rollouts: Sequence, k: int, correct_threshold: float = 1.0,
                 component_names: Optional[Sequence[str]] = None) -> dict:
    """Metrics of scored rollouts, several samples per prompt (grouped by ``rollout.group``).

    ``eval/reward_mean``: mean reward over samples; ``eval/accuracy``: share of samples with
    reward >= ``correct_threshold``; ``eval/pass@1`` and ``eval/pass@{k}``: the unbiased
    estimator averaged over prompts (every prompt needs >= k samples); ``eval/reward/<name>``:
    the mean of each reward component when every rollout carries a ``reward_vector``."""
    _check_scored(rollouts)
    rewards_B = np.asarray([r.reward for r in rollouts], dtype=np.float64)
    correct_B = rewards_B >= correct_threshold
    counts: defaultdict = defaultdict(lambda: [0, 0])  # group -> [samples, correct]
    for r, ok in zip(rollouts, correct_B):
        counts[r.group][0] += 1
        counts[r.group][1] += int(ok)
    n_P, c_P = zip(*counts.values())
    metrics = {"eval/reward_mean": float(rewards_B.mean()), "eval/accuracy": float(correct_B.mean()),
               "eval/pass@1": mean_pass_at_k(n_P, c_P, 1), f"eval/pass@{k}": mean_pass_at_k(n_P, c_P, k)}
    vectors = [r.reward_vector for r in rollouts]
    if any(v is None for v in vectors):
        return metrics
    means_K = np.stack(vectors).astype(np.float64).mean(0)  # (K,)
    names = _component_names(means_K, component_names)
    return {**metrics, **{f"eval/reward/{name}": float(m) for name, m in zip(names, means_K)}}


def render_prompt_text(prompt: Any) -> str:
    """A prompt as readable text: a str as is; a Conversation as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Conversation):
        return "\n".join(f"{m.role}: {m.content}" for m in prompt.messages)
    raise TypeError(f"a prompt is a str or a Conversation, got {type(prompt).__name__}")


def _json_friendly(value: Any) -> Any:
    """``value`` with numpy scalars and arrays, tuples and other objects made JSON types."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _json_friendly(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_friendly(v) for v in value]
    return str(value)


def sample_records(rollouts: Sequence, step: int, component_names: Optional[Sequence[str]] = None,
                   limit: Optional[int] = None) -> list:
    """One JSON-friendly dict per rollout (the first ``limit`` if given), for a person to read:
    ``step``, ``uid``, ``group``, ``prompt`` (text), ``completion``, ``answer``, ``reward``,
    ``reward_components`` (name -> value, or None without a reward vector), ``finish_reason``."""
    _check_scored(rollouts)
    records = []
    for r in list(rollouts)[:limit]:
        components = None
        if r.reward_vector is not None:
            vector_K = np.asarray(r.reward_vector, dtype=np.float64)
            components = {name: float(v) for name, v in zip(_component_names(vector_K, component_names), vector_K)}
        records.append({"step": int(step), "uid": r.uid, "group": r.group, "prompt": render_prompt_text(r.prompt),
                        "completion": r.text, "answer": _json_friendly(r.answer), "reward": float(r.reward),
                        "reward_components": components, "finish_reason": r.finish_reason})
    return records


def write_jsonl_atomic(path: str, records: Sequence[dict]) -> str:
    """Write ``records`` as JSON lines to ``path`` through a temporary file and a rename, so a
    reader never sees half a file (an existing file is replaced). Returns ``path``."""
    lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]  # serialise before writing
    return atomic_file(path, lambda f: f.writelines(lines))
