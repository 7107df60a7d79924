"""Rewards: scalar and vector reward functions, aggregation, shaping, builders, reward models.

Signatures (architecture section 5): ``reward_fn(rollout) -> float | sequence[float]``,
``aggregate_fn(vector) -> float``, ``shaping_fn(rollout, reward) -> float``.
``score_rollout`` composes them and returns a *new* rollout (records are immutable).

A job names its rewards as ``RewardSpec`` records (a built-in of ``BUILTIN_REWARDS`` or a user
``module:function``, a weight, keyword arguments); ``build_reward(specs)`` turns them into
``(reward_fn, aggregate_fn, component_names)`` and raises every configuration error
(``ValueError``) before any Ray work.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from primitives.hooks import arguments_of as _arguments
from primitives.hooks import bind_keywords, did_you_mean, load_function
from primitives.hooks import check_kwargs as _check_kwargs
from primitives.maths.shaping import overlong_penalty


class RewardError(RuntimeError):
    """A reward function failed; the message names the rollout and the function."""


_THINK = re.compile(r"<think>(.*?)(</think>|$)", re.DOTALL)


def parse_thinking(text: str):
    """Split ``<think>...</think>`` from the answer: ``(thinking, answer, closed)``.

    ``closed`` is False when the block never ends (a truncated completion); then the
    answer is empty. Text with no think block is all answer.
    """
    m = _THINK.search(text)
    if m is None:
        return "", text.strip(), True
    closed = m.group(2) == "</think>"
    answer = text[m.end():].strip() if closed else ""
    return m.group(1).strip(), answer, closed


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
    """The smallest component (pessimistic: every objective must be met)."""
    return float(np.min(vector))


def max_aggregator(vector) -> float:
    """The largest component (optimistic: any one objective met is enough)."""
    return float(np.max(vector))


def min_threshold_aggregator(threshold: float = 0.5) -> Callable:
    """0 if any component is below ``threshold``, else the product of the components."""

    def aggregate(vector) -> float:
        v = np.asarray(vector, dtype=np.float64)
        return 0.0 if (v < threshold).any() else float(np.prod(v))

    return aggregate


def lexicographic_aggregator(thresholds: Sequence[float], weights: Optional[Sequence[float]] = None) -> Callable:
    """Components in priority order; a component counts only once every earlier one meets its
    threshold (``x >= t``). Components must lie in [0, 1].

    Returns ``k + v_k / t_k`` where the first k components meet their thresholds and ``v_k`` is
    the first that does not (its progress towards ``t_k``, in [0, 1)); when all K meet theirs,
    ``K + the weighted mean of all components``. Meeting one more threshold is therefore worth
    more than any progress below it, and raising a component never lowers the score (the score
    moves to the next integer band exactly when the component reaches its threshold).
    """
    th = np.asarray(thresholds, dtype=np.float64)
    w = np.asarray(weights if weights is not None else [1.0] * len(th), dtype=np.float64)
    if ((th < 0) | (th > 1)).any():
        raise ValueError(f"lexicographic_aggregator needs thresholds in [0, 1], got {th.tolist()}")
    if len(w) != len(th) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"lexicographic_aggregator needs {len(th)} weights >= 0, not all 0, got {w.tolist()}")

    def aggregate(vector) -> float:
        v = np.asarray(vector, dtype=np.float64)
        if v.size != len(th):
            raise ValueError(f"reward vector has {v.size} components, {len(th)} thresholds given")
        if ((v < 0) | (v > 1)).any():
            raise ValueError(f"lexicographic_aggregator needs components in [0, 1], got {v.tolist()}")
        for k, (x, t) in enumerate(zip(v, th)):
            if x < t:  # t > x >= 0
                return float(k + x / t)
        return float(len(th) + (v @ w) / w.sum())

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

    shape.needs_reference = True  # type: ignore[attr-defined]  # read by the cluster (getattr)
    return shape


def chain_shaping(*fns: Callable) -> Callable:
    """One ``shaping_fn`` applying ``fns`` in order (it needs the reference if any of them does)."""

    def shape(rollout, reward: float) -> float:
        for f in fns:
            reward = f(rollout, reward)
        return reward

    shape.needs_reference = any(getattr(f, "needs_reference", False) for f in fns)  # type: ignore[attr-defined]
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
    """The text after a ``<think>...</think>`` block (empty when the block never closes)."""
    return parse_thinking(text)[1]


# a number with optional thousands separators ("1,234.5") or a plain one ("1234")
_NUMBER_WITH_COMMAS = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER_WITH_COMMAS + ")")
_ANSWER_LABEL = re.compile(r"\banswer\s*:", re.IGNORECASE)


def parse_gsm8k(text: str) -> Optional[str]:
    """The number after the last ``#### `` (GSM8K's answer line, Cobbe et al. 2021,
    arXiv 2110.14168), thousands separators removed: ``"so #### 1,234"`` -> ``"1234"``; or None."""
    found = _GSM8K_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def parse_after_answer(text: str) -> Optional[str]:
    """The first token after the last ``Answer:`` (any case, markdown ``**`` and ``$`` and
    trailing punctuation stripped; a number loses its thousands separators), or None:
    ``"Final answer: $1,234."`` -> ``"1234"``, ``"**Answer:** B"`` -> ``"B"``."""
    labels = list(_ANSWER_LABEL.finditer(text))
    if not labels:
        return None
    for token in text[labels[-1].end():].split():
        token = token.strip("*$`").rstrip(".,;:!?").strip("*$`")
        if token:
            return token.replace(",", "") if re.fullmatch(_NUMBER_WITH_COMMAS, token) else token
    return None


# answer parsers by name, for RewardSpec kwargs (``parser="gsm8k"``); ``parser(text) -> str | None``
ANSWER_PARSERS = {
    "first_number": parse_first_number,
    "last_number": parse_last_number,
    "boxed": parse_boxed,
    "gsm8k": parse_gsm8k,
    "after_answer": parse_after_answer,
    "after_thinking": answer_after_thinking,
}


def unknown_name_error(kind: str, name: str, valid: Sequence[str], extra: str = "") -> ValueError:
    """A ``ValueError`` naming ``name``, the closest valid names (difflib) and all of them."""
    hint = did_you_mean(name, valid, n=3) or "."
    return ValueError(f"unknown {kind} {name!r}{hint} Valid {kind}s: {', '.join(valid)}{extra}")


def _load_user_function(spec: str, what: str) -> Callable:
    """``module:function`` (or ``path/file.py:function``) resolved, as a named ``ValueError`` if not."""
    try:
        return load_function(spec)
    except ValueError as e:
        raise ValueError(f"{what} {spec!r} cannot be loaded: {e}") from None


def get_answer_parser(parser: str | Callable) -> Callable[[str], Optional[str]]:
    """An answer parser from its name in ``ANSWER_PARSERS``, a ``module:function``, or itself."""
    if callable(parser):
        return parser
    if isinstance(parser, str) and ":" in parser:
        return _load_user_function(parser, "answer parser")
    if parser not in ANSWER_PARSERS:
        raise unknown_name_error("answer parser", parser, list(ANSWER_PARSERS), " (or module:function)")
    return ANSWER_PARSERS[parser]


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


def exact_match(parser: str | Callable = "first_number", correct: float = 1.0, wrong: float = 0.0) -> Callable:
    """``exact_match_reward`` with its parser given by name (``ANSWER_PARSERS``): the built-in
    ``exact_match`` of ``RewardSpec``."""
    return exact_match_reward(get_answer_parser(parser), correct=correct, wrong=wrong)


def _parse_reference(parse: Callable, answer: str, timeout_seconds: Optional[int]) -> list:
    """math-verify's parse of a reference answer; bare LaTeX (``x^2+2x+1``) only parses inside ``$``."""
    return parse(answer, parsing_timeout=timeout_seconds) or parse(f"${answer}$", parsing_timeout=timeout_seconds)


def math_verify_reward(parser: str | Callable | None = None, timeout_seconds: Optional[int] = None,
                       correct: float = 1.0, wrong: float = 0.0) -> Callable:
    """``correct`` when the completion is mathematically equivalent to ``rollout.answer``
    (``1/2`` = ``\\frac{1}{2}`` = ``0.5``), checked by Hugging Face's Math-Verify library.

    ``parser`` (an ``ANSWER_PARSERS`` name or a callable) first cuts the answer out of the
    text, e.g. ``"after_thinking"``; None: Math-Verify extracts it from the whole text.
    ``timeout_seconds=None`` disables Math-Verify's ``signal.alarm`` timeout, which raises
    outside the main thread; an int keeps it (main thread only). A reference answer that
    Math-Verify cannot parse raises (a data error, named with the rollout by ``score_rollout``).
    """
    from math_verify import parse, verify  # here, not at module import: only this reward needs it

    cut = get_answer_parser(parser) if parser is not None else None

    def reward_fn(rollout) -> float:
        if rollout.answer is None:
            raise ValueError(f"rollout {rollout.uid} has no reference answer for math_verify_reward")
        gold = _parse_reference(parse, str(rollout.answer), timeout_seconds)
        if not gold:
            raise ValueError(f"math_verify cannot parse the reference answer {rollout.answer!r}")
        text = cut(rollout.text) if cut is not None else rollout.text
        pred = parse(text, parsing_timeout=timeout_seconds) if text else []
        return correct if pred and verify(gold, pred, timeout_seconds=timeout_seconds) else wrong

    reward_fn.__qualname__ = "math_verify_reward" + (f"({_fn_name(cut)})" if cut is not None else "")
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

    reward_fn.__qualname__ = f"length_window_reward({min_tokens}, {max_tokens})"
    return reward_fn


def keyword_reward(keywords: Sequence[str], reward: float = 1.0, case_sensitive: bool = False) -> Callable:
    """``reward`` times the fraction of ``keywords`` the completion contains as whole words
    (``"because"`` counts in "because," but not in "becauses"); a phrase matches as written."""
    if isinstance(keywords, str) or not isinstance(keywords, (list, tuple)) \
            or not all(isinstance(k, str) and k.strip() for k in keywords) or not keywords:
        raise ValueError(f"keyword_reward needs a list of non-empty strings (keywords: [because, therefore]), got "
                         f"{keywords!r}; a bare string would be its letters, and YAML reads yes/no as booleans: quote "
                         "them")
    words = list(keywords)
    flags = 0 if case_sensitive else re.IGNORECASE
    patterns = [re.compile(rf"(?<!\w){re.escape(w.strip())}(?!\w)", flags) for w in words]

    def reward_fn(rollout) -> float:
        return reward * sum(1 for p in patterns if p.search(rollout.text)) / len(patterns)

    reward_fn.__qualname__ = f"keyword_reward({words!r})"
    return reward_fn


def tool_usage_reward(per_success: float = 0.5, per_error: float = -0.5, max_total: float = 1.0) -> Callable:
    """Reward successful tool results, penalise failed ones; clipped to ``[-max_total, max_total]``."""

    def reward_fn(rollout) -> float:
        ok = sum(1 for t in rollout.tool_results if not t.is_error)
        bad = sum(1 for t in rollout.tool_results if t.is_error)
        return float(np.clip(ok * per_success + bad * per_error, -max_total, max_total))

    reward_fn.__qualname__ = "tool_usage_reward"
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


def create_rm_reward_fn(model, tokenizer, render: Optional[Callable] = None) -> Callable:
    """``reward_fn`` scoring ``render(rollout)`` (default: prompt + completion text) with an RM."""
    text = render or (lambda r: (r.prompt if isinstance(r.prompt, str) else "") + r.text)

    def reward_fn(rollout) -> float:
        return float(reward_model_scores(model, tokenizer, [text(rollout)])[0])

    return reward_fn


def create_http_reward_fn(url: str, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                          session=None) -> Callable:
    """``reward_fn`` that POSTs ``{"uid", "prompt", "completion", "answer"}`` as JSON to ``url``
    and reads ``{"reward": float}`` (or a list for vector rewards). Retries connection errors
    and 5xx answers ``retries`` times, then raises naming the URL and the last error."""
    import requests

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"reward server url must start with http:// or https://, got {url!r}")
    if not timeout > 0 or not (isinstance(retries, int) and retries >= 0):
        raise ValueError(f"reward server {url}: timeout must be > 0 and retries an int >= 0, "
                         f"got timeout={timeout!r}, retries={retries!r}")

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

    reward_fn.__qualname__ = f"http_reward({url})"
    return reward_fn


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_reward_model_dir(path: str) -> None:
    """Raise a ``ValueError`` unless ``path`` is a directory with ``config.json`` and a tokenizer."""
    if not os.path.isdir(path):
        raise ValueError(f"reward model path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"reward model directory {path!r} has no config.json (a saved Hugging Face "
                         "AutoModelForSequenceClassification checkpoint is needed)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"reward model directory {path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")


def reward_model_reward(path: str, device: str = "cpu") -> Callable:
    """``reward_fn`` scoring prompt + completion with the sequence-classification model at ``path``.

    The directory is checked now; the model loads on the first call, i.e. on the reward
    worker, not in the driver (the function travels to the worker unloaded)."""
    check_reward_model_dir(path)
    loaded = {}  # filled on the first call: {"fn": the reward function of the loaded model}

    def reward_fn(rollout) -> float:
        if "fn" not in loaded:
            loaded["fn"] = create_rm_reward_fn(*load_reward_model(path, device))
        return loaded["fn"](rollout)

    reward_fn.__qualname__ = f"reward_model_reward({path})"
    return reward_fn


# ----------------------------------------------------------------------------- reward specs

# Built-in rewards by name: a factory each; a RewardSpec's kwargs are the factory's arguments.
BUILTIN_REWARDS: dict[str, Callable] = {
    "exact_match": exact_match,
    "math_verify": math_verify_reward,
    "regex_format": regex_format_reward,
    "length_window": length_window_reward,
    "keywords": keyword_reward,
    "tool_usage": tool_usage_reward,
    "reward_model": reward_model_reward,
    "http": create_http_reward_fn,
}

# rollout_metrics already logs reward/mean, reward/std, reward/min, reward/max
_RESERVED_LABELS = ("mean", "std", "min", "max")


class RewardSpec(NamedTuple):
    """One reward of a job, as a config names it."""

    name: str  # a BUILTIN_REWARDS name, or a user reward_fn as "module:function" / "path/file.py:function"
    weight: float = 1.0  # its weight in the weighted sum of several rewards
    kwargs: Optional[dict[str, Union[bool, int, float, str]]] = None  # the built-in factory's keyword arguments;
    # for a user function, keyword arguments bound to it: reward_fn(rollout, **kwargs)
    label: Optional[str] = None  # logged as reward/<label>; default: name (the function's name for module:function)


def _builtin_reward(name: str, kwargs: dict) -> Callable:
    """The built-in ``name`` made by its factory; bad arguments or values -> ``ValueError``."""
    factory = BUILTIN_REWARDS[name]
    _check_kwargs(f"reward {name!r}", factory, kwargs)
    try:
        fn = factory(**kwargs)
    except (TypeError, ValueError, re.error) as e:
        raise ValueError(f"reward {name!r} with {kwargs}: {e}; accepted arguments: {_arguments(factory)}") from None
    return fn


def _user_reward(name: str, kwargs: dict) -> Callable:
    """The user function ``module:function`` with ``kwargs`` bound, named ``name`` in errors."""
    bound = bind_keywords(f"reward function {name!r}", _load_user_function(name, "reward function"), kwargs,
                          positional=1)

    def reward_fn(rollout):
        return bound(rollout)

    reward_fn.__qualname__ = name  # errors name the spec (module:function)
    return reward_fn


def make_reward(spec: RewardSpec) -> Callable:
    """One ``reward_fn(rollout) -> float`` from one spec; every configuration error is a
    ``ValueError`` naming the reward and what would be right. Loads no model."""
    kwargs = {} if spec.kwargs is None else spec.kwargs
    if not isinstance(kwargs, dict):
        raise ValueError(f"reward {spec.name!r}: kwargs must be a dict of keyword arguments, got {kwargs!r}")
    if isinstance(spec.name, str) and ":" in spec.name:
        return _user_reward(spec.name, dict(kwargs))
    if spec.name not in BUILTIN_REWARDS:
        raise unknown_name_error("reward", spec.name, list(BUILTIN_REWARDS), "; or a user function as module:function")
    return _builtin_reward(spec.name, dict(kwargs))


def reward_label(spec: RewardSpec) -> str:
    """The name ``spec``'s component is logged under: ``reward/<label>``."""
    return spec.label if spec.label is not None else str(spec.name).rpartition(":")[2]


def _check_labels(labels: Sequence[str]) -> None:
    for label in labels:
        if not isinstance(label, str) or not re.fullmatch(r"[\w.-]+", label) or label in _RESERVED_LABELS:
            raise ValueError(f"reward label {label!r} cannot name a reward/<label> metric: use letters, digits, "
                             f"'_', '.', '-', and none of {', '.join(_RESERVED_LABELS)}")
    dupes = sorted({x for x in labels if list(labels).count(x) > 1})
    if dupes:
        raise ValueError(f"two rewards are logged as {', '.join(dupes)}; give each RewardSpec a distinct label=")


def _check_weights(specs: Sequence[RewardSpec]) -> list:
    weights = []
    for s in specs:
        if isinstance(s.weight, bool) or not isinstance(s.weight, (int, float)) or not math.isfinite(s.weight):
            raise ValueError(f"reward {reward_label(s)!r} has weight {s.weight!r}; a weight is a finite number")
        weights.append(float(s.weight))
    if not any(weights):
        raise ValueError(f"all reward weights are 0 ({', '.join(reward_label(s) for s in specs)}): "
                         "every rollout would score 0")
    return weights


def with_weights(specs: Sequence[RewardSpec], weights: Sequence[float]) -> tuple:
    """``specs`` with their weights replaced by ``weights``, one per reward (else ``ValueError``)."""
    specs, weights = list(specs), list(weights)
    if len(weights) != len(specs):
        raise ValueError(f"{len(weights)} reward weights {weights} given for {len(specs)} rewards "
                         f"({', '.join(reward_label(s) for s in specs)}); give one weight per reward")
    return tuple(s._replace(weight=w) for s, w in zip(specs, weights))


def scaled_reward(reward_fn: Callable, weight: float) -> Callable:
    """``weight * reward_fn(rollout)`` (``reward_fn`` itself when the weight is 1)."""
    if weight == 1.0:
        return reward_fn

    def scaled(rollout):
        return weight * reward_fn(rollout)

    scaled.__qualname__ = f"{weight}*{_fn_name(reward_fn)}"
    return scaled


def build_reward(specs: Sequence[RewardSpec]) -> tuple:
    """``(reward_fn, aggregate_fn, component_names)`` of a job's rewards, checked now.

    One spec: a scalar ``reward_fn`` (times its weight), ``aggregate_fn`` None. Several: a
    vector ``reward_fn`` (K,) and the weighted sum of the components as ``aggregate_fn``.
    ``component_names``: the K labels, logged as ``reward/<label>`` by ``rollout_metrics``.
    Every error (unknown name, bad arguments, unimportable function, bad weights or labels,
    a reward model directory without config.json) is a ``ValueError`` raised here.
    """
    if isinstance(specs, RewardSpec):
        raise ValueError(f"build_reward takes a list of RewardSpec records, got one: pass [{specs!r}]")
    specs = list(specs)
    for s in specs:
        if not isinstance(s, RewardSpec):
            raise ValueError(f"build_reward takes RewardSpec records, got {s!r}")
    if not specs:
        raise ValueError("no rewards given: give at least one RewardSpec")
    names = tuple(reward_label(s) for s in specs)
    _check_labels(names)
    weights = _check_weights(specs)
    fns = [make_reward(s) for s in specs]
    if len(fns) == 1:
        return scaled_reward(fns[0], weights[0]), None, names
    return vector_reward_fn(*fns), weighted_sum_aggregator(weights), names
