"""Rewards: builders, aggregators, shaping, scoring errors, reward model, HTTP reward."""
import itertools
import json
import math
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from primitives.env import rewards as R
from primitives.env.tools import ToolResult
from primitives.types import Rollout
from tests.conftest import local_http_server


def _rollout(text="", n_tokens=3, answer=None, tool_results=(), uid="e0/i0/s0"):
    return Rollout(uid=uid, group="e0/i0", prompt="p", prompt_ids=np.array([1]),
                   completion_ids=np.arange(n_tokens), loss_mask=np.ones(n_tokens, np.float32),
                   logprobs=np.zeros(n_tokens, np.float32), text=text, answer=answer, tool_results=tool_results)


def test_aggregators_hand_values():
    assert R.weighted_sum_aggregator([2.0, 4.0])([1.0, 0.5]) == 4.0
    assert R.mean_aggregator([1.0, 0.0, 0.5]) == 0.5
    assert R.min_aggregator([1.0, -2.0]) == -2.0
    assert R.min_threshold_aggregator(0.5)([0.6, 0.9]) == pytest.approx(0.54)
    assert R.min_threshold_aggregator(0.5)([0.4, 0.9]) == 0.0
    lex = R.lexicographic_aggregator([0.9, 0.7])
    assert lex([0.45, 1.0]) == pytest.approx(0.5)  # first priority fails: its progress 0.45 / 0.9 only
    assert lex([0.95, 0.56]) == pytest.approx(1.8)  # first passes, second fails: 1 + 0.56 / 0.7
    assert lex([0.95, 0.8]) == pytest.approx(2.875)  # all pass: 2 + mean
    assert lex([0.89, 1.0]) < lex([0.9, 0.0])  # any gain on priority 1 beats all of priority 2
    with pytest.raises(ValueError, match="components"):
        R.weighted_sum_aggregator([1.0])([1.0, 2.0])


def test_lexicographic_meeting_a_threshold_never_lowers_the_score():
    """Thresholds (0.5, 0.9): (0.5, 0.89) scores 1 + 0.89 / 0.9 and (0.5, 0.90) meets both,
    2 + mean 0.7, higher; a component exactly on its threshold meets it."""
    lex = R.lexicographic_aggregator([0.5, 0.9])
    assert lex([0.5, 0.89]) == pytest.approx(1 + 0.89 / 0.9)
    assert lex([0.5, 0.9]) == pytest.approx(2.7)
    assert lex([0.5, 0.9]) > lex([0.5, 0.89])
    binary = R.lexicographic_aggregator([1.0, 1.0])
    assert [binary([1, 1]), binary([1, 0]), binary([0, 1])] == [3.0, 1.0, 0.0]
    assert R.lexicographic_aggregator([0.0, 0.5])([0.0, 0.25]) == pytest.approx(1.5)  # threshold 0: always met
    with pytest.raises(ValueError, match="thresholds in \\[0, 1\\]"):
        R.lexicographic_aggregator([1.5])
    with pytest.raises(ValueError, match="weights"):
        R.lexicographic_aggregator([0.5, 0.5], weights=[0.0, 0.0])


unit = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), k=st.integers(1, 4))
def test_lexicographic_is_monotone_in_every_component(data, k):
    """For any thresholds, weights and components in [0, 1]: raising one component never
    lowers the aggregate, and the score lies in the band of the number of leading thresholds
    met (so meeting one more beats any progress below it). Hypothesis picks how many leading
    components meet their thresholds, and a raise may go from just below a threshold to
    exactly on it, where a score can jump."""
    thresholds = data.draw(st.lists(unit, min_size=k, max_size=k))
    weights = data.draw(st.lists(st.floats(0.01, 10.0), min_size=k, max_size=k))
    lex = R.lexicographic_aggregator(thresholds, weights)
    lead = data.draw(st.integers(0, k))
    v = [data.draw(st.floats(t, 1.0) if j < lead else st.one_of(unit, st.just(t))) for j, t in enumerate(thresholds)]
    i = data.draw(st.integers(0, k - 1))
    low = data.draw(st.one_of(unit, st.just(math.nextafter(thresholds[i], 0.0))))
    high = data.draw(st.one_of(st.floats(low, 1.0), st.just(max(low, thresholds[i]))))
    before, raised = list(v), list(v)
    before[i], raised[i] = low, high
    assert lex(raised) >= lex(before)
    for u in (before, raised):
        met = sum(1 for _ in itertools.takewhile(lambda p: p[0] >= p[1], zip(u, thresholds)))
        assert met <= lex(u) <= met + 1  # (k + progress below 1 may round up to k + 1)


def test_overlong_penalty_hand_values():
    f = R.overlong_penalty(max_len=10, buffer=4, penalty=1.0)
    assert [f(6), f(8), f(10), f(12)] == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        R.overlong_penalty(10, 0)


def test_shaping():
    r = _rollout(n_tokens=8)
    assert R.length_penalty(0.1, 5)(r, 1.0) == pytest.approx(0.7)
    assert R.dapo_overlong_shaping(10, 4)(r, 1.0) == pytest.approx(0.5)
    kl = r._replace(logprobs=np.full(8, -1.0, np.float32), ref_logprobs=np.full(8, -1.5, np.float32))
    assert R.kl_penalty_shaping(0.1)(kl, 1.0) == pytest.approx(1.0 - 0.1 * 4.0)
    both = R.chain_shaping(R.length_penalty(0.1, 5), R.dapo_overlong_shaping(10, 4))
    assert both(r, 1.0) == pytest.approx(0.2)


def test_builders():
    em = R.exact_match_reward()
    assert em(_rollout("47 apples", answer="47")) == 1.0
    assert em(_rollout("the sum is 46", answer=47)) == 0.0
    assert em(_rollout("no number", answer="3")) == 0.0
    assert R.exact_match_reward(R.parse_boxed)(_rollout(r"so \boxed{x^{2}}", answer="x^{2}")) == 1.0
    assert R.exact_match_reward(R.answer_after_thinking)(_rollout("<think>hmm</think>12", answer="12")) == 1.0
    fmt = R.regex_format_reward(r"<think>.*</think>\s*\d+")
    assert fmt(_rollout("<think>a</think> 5")) == 1.0 and fmt(_rollout("5")) == 0.0
    win = R.length_window_reward(2, 4)
    assert [win(_rollout(n_tokens=n)) for n in (1, 2, 4, 5)] == [0.0, 1.0, 1.0, 0.0]
    tools = (ToolResult("c0", "calc", "5"), ToolResult("c1", "calc", "error: x", True), ToolResult("c2", "calc", "1"))
    assert R.tool_usage_reward(0.5, -0.25)(_rollout(tool_results=tools)) == pytest.approx(0.75)


def test_score_rollout_scalar_vector_and_errors():
    r = _rollout("5", answer="5")
    scored = R.score_rollout(r, R.exact_match_reward())
    assert scored.reward == 1.0 and r.reward is None  # a new record; the input is unchanged
    vec = R.vector_reward_fn(R.exact_match_reward(), R.length_window_reward(0, 1))
    scored = R.score_rollout(r, vec, R.weighted_sum_aggregator([0.7, 0.3]))
    assert scored.reward_vector.tolist() == [1.0, 0.0] and scored.reward == pytest.approx(0.7)
    with pytest.raises(ValueError, match="pass aggregate_fn"):
        R.score_rollout(r, vec)

    def broken(rollout):
        raise KeyError("missing")

    with pytest.raises(R.RewardError, match=r"broken raised on rollout e0/i0/s0: KeyError"):
        R.score_rollout(r, broken)
    with pytest.raises(R.RewardError, match="returned nan for rollout e0/i0/s0"):
        R.score_rollout(r, lambda x: float("nan"))


def test_reward_model_scores(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = R.load_reward_model(str(tmp_path))
    texts = ["1+1=2", "12+30=42 and more"]
    batched = R.reward_model_scores(model, tok, texts)
    single = [R.reward_model_scores(model, tok, [t])[0] for t in texts]
    np.testing.assert_allclose(batched, single, atol=1e-5)  # padding does not change scores
    fn = R.create_rm_reward_fn(model, tok, render=lambda r: r.text)
    assert fn(_rollout(texts[1])) == pytest.approx(float(single[1]), abs=1e-5)
    with pytest.raises(FileNotFoundError, match="reward model path not found"):
        R.load_reward_model(str(tmp_path / "nope"))


class _Handler(BaseHTTPRequestHandler):
    fail_first = 0
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        out = json.dumps({"reward": 1.0 if body["completion"].strip() == body["answer"] else 0.0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    _Handler.calls, _Handler.fail_first = 0, 0
    with local_http_server(_Handler) as server:
        yield server


def test_http_reward_with_retries(reward_server):
    url = f"http://127.0.0.1:{reward_server.server_port}/score"
    fn = R.create_http_reward_fn(url, timeout=2.0, retries=2, backoff=0.01)
    assert fn(_rollout("7", answer="7")) == 1.0
    _Handler.calls, _Handler.fail_first = 0, 2
    assert fn(_rollout("7", answer="8")) == 0.0 and _Handler.calls == 3  # two 503s, then an answer
    _Handler.calls, _Handler.fail_first = 0, 10
    with pytest.raises(R.RewardError, match=r"failed for rollout e0/i0/s0 after 3 attempts .*HTTP 503"):
        fn(_rollout("7", answer="7"))


def test_http_reward_unreachable_names_url():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    fn = R.create_http_reward_fn(f"http://127.0.0.1:{port}/x", timeout=0.5, retries=1, backoff=0.01)
    with pytest.raises(R.RewardError, match=f"127.0.0.1:{port}.*ConnectionError"):
        fn(_rollout("1", answer="1"))


class _FakeResponse:
    def __init__(self, status_code: int, body=None):
        self.status_code, self._body, self.text = status_code, body, json.dumps(body) if body else "go away"

    def json(self):
        return self._body


class _FakeSession:
    """``session.post`` answering from a script of (status, body) pairs; counts calls; no network."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def post(self, url, json=None, timeout=None):
        self.calls.append((url, json, timeout))
        return _FakeResponse(*self.answers[min(len(self.calls), len(self.answers)) - 1])


@pytest.mark.parametrize("status", [400, 404])
def test_http_reward_client_errors_are_not_retried(status):
    session = _FakeSession((status, None))
    fn = R.create_http_reward_fn("http://scorer.test/score", retries=3, backoff=0, session=session)
    with pytest.raises(R.RewardError, match=f"http://scorer.test/score rejected rollout e0/i0/s0: HTTP {status}"):
        fn(_rollout("7", answer="7"))
    assert len(session.calls) == 1
    assert session.calls[0][1] == {"uid": "e0/i0/s0", "completion": "7", "prompt": "p", "answer": "7"}


def test_http_reward_server_errors_are_retried_then_named():
    session = _FakeSession((503, None))
    fn = R.create_http_reward_fn("http://scorer.test/score", retries=2, backoff=0, session=session)
    with pytest.raises(R.RewardError, match=r"http://scorer.test/score failed .* after 3 attempts .*HTTP 503"):
        fn(_rollout("7", answer="7"))
    assert len(session.calls) == 3  # retries + 1


def test_http_reward_recovers_after_a_server_error():
    session = _FakeSession((503, None), (200, {"reward": 0.25}))
    fn = R.create_http_reward_fn("http://scorer.test/score", retries=2, backoff=0, session=session)
    assert fn(_rollout("7", answer="7")) == 0.25
    assert len(session.calls) == 2


def test_last_number_parser_and_chat_arithmetic():
    from primitives.env.rewards import parse_last_number
    from primitives.fixtures.tasks import (
        ArithmeticTaskSpec,
        chat_arithmetic_items,
        chat_arithmetic_reward,
        make_arithmetic_task,
    )
    from primitives.types import Conversation, Rollout

    assert parse_last_number("23 + 48 = 71") == "71" and parse_last_number("no digits") is None
    assert parse_last_number("from -3 to 4.5.") == "4.5"
    item = chat_arithmetic_items(make_arithmetic_task(ArithmeticTaskSpec(num_train=1, num_heldout=1, seed=5))[0])[0]
    a, b = item.metadata["a"], item.metadata["b"]
    assert isinstance(item.prompt, Conversation) and item.prompt.messages[0].content == f"What is {a}+{b}? " \
        "Reply with the number only." and item.answer == str(a + b)

    def scored(text):
        return chat_arithmetic_reward(Rollout("u", "g", item.prompt, None, None, None, None, text=text,
                                              answer=item.answer))

    assert scored(f"{a} + {b} = {a + b}") == 1.0 and scored(f"{a + b}") == 1.0 and scored(f"{a + b + 10}") == 0.0


def test_min_max_mean_aggregators_hand_values():
    from primitives.env.rewards import max_aggregator, mean_aggregator, min_aggregator

    v = [0.2, 0.9, 0.4]
    assert (min_aggregator(v), max_aggregator(v)) == (0.2, 0.9)
    assert mean_aggregator(v) == pytest.approx(0.5, abs=1e-15)
