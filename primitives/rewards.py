"""Rewards: scalar and vector reward functions, aggregation, shaping, builders, reward models.

Signatures (DESIGN section 5): ``reward_fn(rollout) -> float | sequence[float]``,
``aggregate_fn(vector) -> float``, ``shaping_fn(rollout, reward) -> float``.
``score_rollout`` composes them and returns a *new* rollout (records are immutable).
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Callable, Optional, Sequence

import numpy as np

from primitives.generation import parse_thinking


class RewardError(RuntimeError):
    """A reward function failed; the message names the rollout and the function."""


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _finite(value, rollout, fn) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward function {_fn_name(fn)} returned {value!r} for rollout {rollout.uid}; "
                          "expected a number") from None
    if not math.isfinite(v):
        raise RewardError(f"reward function {_fn_name(fn)} returned {v} for rollout {rollout.uid}")
    return v


def compute_scalar_reward(rollout, reward_fn: Callable) -> float:
    """``reward_fn(rollout)`` checked to be one finite float."""
    try:
        value = reward_fn(rollout)
    except RewardError:
        raise
    except Exception as e:  # user code: report which function failed on which rollout
        raise RewardError(f"reward function {_fn_name(reward_fn)} raised on rollout {rollout.uid}: "
                          f"{type(e).__name__}: {e}") from e
    return _finite(value, rollout, reward_fn)


def compute_vector_reward(rollout, reward_fns: Sequence[Callable]) -> np.ndarray:
    """One component per function: (K,) float32."""
    return np.asarray([compute_scalar_reward(rollout, f) for f in reward_fns], dtype=np.float32)


# ----------------------------------------------------------------------------- aggregation

def weighted_sum_aggregator(weights: Sequence[float]) -> Callable:
    w = np.asarray(weights, dtype=np.float64)

    def aggregate(vector) -> float:
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != w.shape:
            raise ValueError(f"reward vector has {v.size} components, weights have {w.size}")
        return float(v @ w)

    return aggregate


def mean_aggregator(vector) -> float:
    return float(np.mean(vector))


def min_aggregator(vector) -> float:
    return float(np.min(vector))


def min_threshold_aggregator(threshold: float = 0.5) -> Callable:
    """0 if any component is below ``threshold``, else the product of the components."""

    def aggregate(vector) -> float:
        v = np.asarray(vector, dtype=np.float64)
        return 0.0 if (v < threshold).any() else float(np.prod(v))

    return aggregate


def lexicographic_aggregator(thresholds: Sequence[float], weights: Optional[Sequence[float]] = None) -> Callable:
    """Components in priority order; a component counts only once every earlier one meets
    its threshold. Components must lie in [0, 1].

    Returns ``k + v_k`` where k earlier components passed and v_k is the first failing one
    (or ``K - 1 + weighted mean`` when all pass), so any gain on a higher priority beats
    every gain on a lower one.
    """
    th = list(thresholds)
    w = np.asarray(weights if weights is not None else [1.0] * len(th), dtype=np.float64)

    def aggregate(vector) -> float:
        v = np.asarray(vector, dtype=np.float64)
        if v.size != len(th):
            raise ValueError(f"reward vector has {v.size} components, {len(th)} thresholds given")
        if ((v < 0) | (v > 1)).any():
            raise ValueError(f"lexicographic_aggregator needs components in [0, 1], got {v.tolist()}")
        for k, (x, t) in enumerate(zip(v, th)):
            if x < t:
                return float(k + x)
        return float(len(th) - 1 + (v @ w) / w.sum())

    return aggregate


def aggregate_vector_rewards(vector, aggregate_fn: Callable) -> float:
    value = aggregate_fn(vector)
    if not math.isfinite(value):
        raise ValueError(f"aggregator {_fn_name(aggregate_fn)} returned {value} for {list(vector)}")
    return float(value)


# ----------------------------------------------------------------------------- shaping

def length_penalty(coef: float, target_len: int) -> Callable:
    """``shaping_fn`` subtracting ``coef`` per token beyond ``target_len``."""

    def shape(rollout, reward: float) -> float:
        return reward - coef * max(0, rollout.num_tokens - target_len)

    return shape


def overlong_penalty(max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO soft overlong punishment for one length (arXiv 2503.14476, eq. 13), as a function
    ``L -> penalty``: 0 up to ``max_len - buffer``, then linear down to ``-penalty`` at
    ``max_len``, and ``-penalty`` beyond."""
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")

    def value(length: int) -> float:
        start = max_len - buffer
        if length <= start:
            return 0.0
        if length <= max_len:
            return -penalty * (length - start) / buffer
        return -penalty

    return value


def dapo_overlong_shaping(max_len: int, buffer: int, penalty: float = 1.0) -> Callable:
    """``shaping_fn`` adding DAPO's soft overlong penalty to the reward."""
    value = overlong_penalty(max_len, buffer, penalty)

    def shape(rollout, reward: float) -> float:
        return reward + value(rollout.num_tokens)

    return shape


def kl_penalty_shaping(coef: float) -> Callable:
    """``shaping_fn`` subtracting ``coef * sum_t k1`` (sequence KL to the reference; needs
    ref_logprobs on the rollout). Used for sequence-level KL-in-reward.

    The returned function has ``needs_reference = True``: on Ray the cluster then creates a
    reference worker and scores rollouts after their reference logprobs exist. A user's
    shaping function that reads ``ref_logprobs`` sets the same attribute."""

    def shape(rollout, reward: float) -> float:
        if rollout.ref_logprobs is None:
            raise ValueError(f"rollout {rollout.uid}: KL shaping needs ref_logprobs")
        m = rollout.loss_mask
        return reward - coef * float(((rollout.logprobs - rollout.ref_logprobs) * m).sum())

    shape.needs_reference = True
    return shape


def chain_shaping(*fns: Callable) -> Callable:
    """One ``shaping_fn`` applying ``fns`` in order (it needs the reference if any of them does)."""

    def shape(rollout, reward: float) -> float:
        for f in fns:
            reward = f(rollout, reward)
        return reward

    shape.needs_reference = any(getattr(f, "needs_reference", False) for f in fns)
    return shape


def score_rollout(rollout, reward_fn: Callable, aggregate_fn: Optional[Callable] = None,
                  shaping_fn: Optional[Callable] = None):
    """A new rollout with ``reward`` (and ``reward_vector`` for vector rewards) set.

    ``reward_fn`` may return a number or a sequence (vector); a sequence needs ``aggregate_fn``.
    """
    try:
        raw = reward_fn(rollout)
    except Exception as e:
        if isinstance(e, RewardError):
            raise
        raise RewardError(f"reward function {_fn_name(reward_fn)} raised on rollout {rollout.uid}: "
                          f"{type(e).__name__}: {e}") from e
    vector = None
    if isinstance(raw, (list, tuple, np.ndarray)):
        vector = np.asarray([_finite(x, rollout, reward_fn) for x in raw], dtype=np.float32)
        if aggregate_fn is None:
            raise ValueError(f"reward function {_fn_name(reward_fn)} returned a vector for rollout "
                             f"{rollout.uid}; pass aggregate_fn")
        reward = aggregate_vector_rewards(vector, aggregate_fn)
    else:
        reward = _finite(raw, rollout, reward_fn)
    if shaping_fn is not None:
        reward = _finite(shaping_fn(rollout, reward), rollout, shaping_fn)
    return rollout._replace(reward=reward, reward_vector=vector)


def score_rollouts(rollouts, reward_fn, aggregate_fn=None, shaping_fn=None) -> list:
    return [score_rollout(r, reward_fn, aggregate_fn, shaping_fn) for r in rollouts]


def vector_reward_fn(*reward_fns: Callable) -> Callable:
    """Compose scalar reward functions into one vector reward function."""

    def reward_fn(rollout):
        return compute_vector_reward(rollout, reward_fns)

    reward_fn.__qualname__ = "vector_reward_fn(" + ", ".join(_fn_name(f) for f in reward_fns) + ")"
    return reward_fn


# ----------------------------------------------------------------------------- builders

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_first_number(text: str) -> Optional[str]:
    """The first (optionally negative, optionally decimal) number in the text, or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def parse_last_number(text: str) -> Optional[str]:
    """The last number in the text, or None: the answer of a model that works before it
    answers ("23 + 48 = 71")."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def parse_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}``, or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed{")
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                return text[start:j].strip()
            depth -= 1
    return None


def answer_after_thinking(text: str) -> str:
    return parse_thinking(text)[1]


def exact_match_reward(answer_parser: Callable[[str], Optional[str]] = parse_first_number,
                       correct: float = 1.0, wrong: float = 0.0) -> Callable:
    """Reward ``correct`` when ``answer_parser(rollout.text) == str(rollout.answer)``."""

    def reward_fn(rollout) -> float:
        if rollout.answer is None:
            raise ValueError(f"rollout {rollout.uid} has no reference answer for exact_match_reward")
        got = answer_parser(rollout.text)
        return correct if got is not None and got.strip() == str(rollout.answer).strip() else wrong

    reward_fn.__qualname__ = f"exact_match_reward({_fn_name(answer_parser)})"
    return reward_fn


def regex_format_reward(pattern: str, reward: float = 1.0, flags: int = re.DOTALL) -> Callable:
    """``reward`` when the whole completion matches ``pattern``, else 0."""
    rx = re.compile(pattern, flags)

    def reward_fn(rollout) -> float:
        return reward if rx.fullmatch(rollout.text.strip()) else 0.0

    reward_fn.__qualname__ = f"regex_format_reward({pattern!r})"
    return reward_fn


def length_window_reward(min_tokens: int, max_tokens: int, reward: float = 1.0) -> Callable:
    """``reward`` when the completion length is within [min_tokens, max_tokens]."""
    if min_tokens > max_tokens:
        raise ValueError(f"length window [{min_tokens}, {max_tokens}] is empty")

    def reward_fn(rollout) -> float:
        return reward if min_tokens <= rollout.num_tokens <= max_tokens else 0.0

    return reward_fn


def tool_usage_reward(per_success: float = 0.5, per_error: float = -0.5, max_total: float = 1.0) -> Callable:
    """Reward successful tool results, penalise failed ones; clipped to ``[-max_total, max_total]``."""

    def reward_fn(rollout) -> float:
        ok = sum(1 for t in rollout.tool_results if not t.is_error)
        bad = sum(1 for t in rollout.tool_results if t.is_error)
        return float(np.clip(ok * per_success + bad * per_error, -max_total, max_total))

    return reward_fn


# ----------------------------------------------------------------------------- reward models

def load_reward_model(path: str, device: str = "cpu"):
    """``(model, tokenizer)`` of a local ``AutoModelForSequenceClassification`` checkpoint."""
    import os

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"reward model path not found: {path}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, tok


def reward_model_scores(model, tokenizer, texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
    """Scalar score (logit 0) of each text: (N,) float32."""
    import torch

    out = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for s in range(0, len(texts), batch_size):
            enc = tokenizer(list(texts[s: s + batch_size]), return_tensors="pt", padding=True)
            logits = model(**{k: v.to(device) for k, v in enc.items()}).logits
            out.append(logits[:, 0].float().cpu())
    return torch.cat(out).numpy().astype(np.float32)


def create_rm_reward_fn(model, tokenizer, render: Callable = None) -> Callable:
    """``reward_fn`` scoring ``render(rollout)`` (default: prompt + completion text) with an RM."""
    render = render or (lambda r: (r.prompt if isinstance(r.prompt, str) else "") + r.text)

    def reward_fn(rollout) -> float:
        return float(reward_model_scores(model, tokenizer, [render(rollout)])[0])

    return reward_fn


def create_http_reward_fn(url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                          session=None) -> Callable:
    """``reward_fn`` that POSTs ``{"uid", "prompt", "completion", "answer"}`` as JSON to ``url``
    and reads ``{"reward": float}`` (or a list for vector rewards). Retries connection errors
    and 5xx answers ``retries`` times, then raises naming the URL and the last error."""
    import requests

    http = session or requests.Session()

    def reward_fn(rollout):
        payload = {"uid": rollout.uid, "completion": rollout.text,
                   "prompt": rollout.prompt if isinstance(rollout.prompt, str) else None,
                   "answer": rollout.answer}
        last = None
        for attempt in range(retries + 1):
            try:
                resp = http.post(url, json=payload, timeout=timeout)
                if resp.status_code >= 500:
                    last = f"HTTP {resp.status_code}"
                elif resp.status_code >= 400:
                    raise RewardError(f"reward server {url} rejected rollout {rollout.uid}: "
                                      f"HTTP {resp.status_code} {resp.text[:200]}")
                else:
                    body = resp.json()
                    if "reward" not in body:
                        raise RewardError(f"reward server {url} answered without 'reward': {json.dumps(body)[:200]}")
                    return body["reward"]
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < retries:
                time.sleep(backoff * 2 ** attempt)
        raise RewardError(f"reward server {url} failed for rollout {rollout.uid} after "
                          f"{retries + 1} attempts (timeout {timeout}s): {last}")

    return reward_fn
