"""Rewards by name: answer parsers, math-verify, RewardSpec -> build_reward, their errors, and
per-component logging (``reward/<label>``)."""
import threading

import numpy as np
import pytest

from primitives.env import rewards as R
from primitives.env.rewards import RewardSpec, build_reward
from primitives.maths.algorithms import AlgorithmConfig
from primitives.maths.batching import make_batch, rollout_metrics
from primitives.types import Rollout

USER_MODULE = '''
def has_word(rollout, word="yes"):
    return 1.0 if word in rollout.text else 0.0

def broken(rollout):
    raise KeyError("oops")

def nan_reward(rollout):
    return float("nan")
'''


def _rollout(text="", n_tokens=3, answer=None, uid="e0/i0/s0", group="e0/i0"):
    return Rollout(uid=uid, group=group, prompt="p", prompt_ids=np.array([1]),
                   completion_ids=np.arange(n_tokens), loss_mask=np.ones(n_tokens, np.float32),
                   logprobs=np.zeros(n_tokens, np.float32), text=text, answer=answer)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module ``spec_test_rewards`` of user reward functions."""
    (tmp_path / "spec_test_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "spec_test_rewards"


# ----------------------------------------------------------------------------- parsers

def test_number_and_boxed_parsers_hand_values():
    assert R.parse_first_number("x = -3.5, then 7") == "-3.5"
    assert R.parse_last_number("x = -3.5, then 7.") == "7"
    assert R.parse_boxed(r"\boxed{1} then \boxed{\frac{a}{b^{2}}} done") == r"\frac{a}{b^{2}}"
    assert R.parse_boxed(r"\boxed{unclosed {") is None and R.parse_boxed("none") is None


def test_gsm8k_parser_hand_values():
    assert R.parse_gsm8k("48/2 = 24\n#### 72") == "72"
    assert R.parse_gsm8k("#### 1,234") == "1234"
    assert R.parse_gsm8k("#### $1,234,567.50.") == "1234567.50"
    assert R.parse_gsm8k("#### -5") == "-5"
    assert R.parse_gsm8k("#### Step 1\n3 + 4 = 7\n#### 7") == "7"  # a markdown heading is not an answer
    assert R.parse_gsm8k("#### 12 but then #### 13") == "13"  # the last answer line counts
    assert R.parse_gsm8k("the answer is 72") is None


def test_after_answer_parser_hand_values():
    assert R.parse_after_answer("Answer: 42") == "42"
    assert R.parse_after_answer("so ANSWER:42.") == "42"
    assert R.parse_after_answer("Final answer: $1,234.") == "1234"
    assert R.parse_after_answer("**Answer:** B") == "B"
    assert R.parse_after_answer("answer: x^2 is it") == "x^2"
    assert R.parse_after_answer("Answer: 3/4") == "3/4"  # a fraction is one token, not the number 3
    assert R.parse_after_answer("Answer: 1, then answer: 2") == "2"  # the last label counts
    assert R.parse_after_answer("Answer:") is None and R.parse_after_answer("42") is None


def test_answer_parsers_by_name(user_module):
    assert set(R.ANSWER_PARSERS) == {"first_number", "last_number", "boxed", "gsm8k", "after_answer",
                                     "after_thinking"}
    assert R.get_answer_parser("gsm8k") is R.parse_gsm8k
    assert R.get_answer_parser(R.parse_boxed) is R.parse_boxed
    with pytest.raises(ValueError, match=r"unknown answer parser 'gsm8kk'; did you mean 'gsm8k'\? "
                                         r"Valid answer parsers: first_number, last_number, boxed, gsm8k"):
        R.get_answer_parser("gsm8kk")
    assert R.get_answer_parser(f"{user_module}:has_word")(_rollout("yes")) == 1.0
    with pytest.raises(ValueError, match="answer parser 'nowhere_mod:f' cannot be loaded"):
        R.get_answer_parser("nowhere_mod:f")


def test_exact_match_by_parser_name():
    em = R.exact_match(parser="gsm8k")
    assert em(_rollout("3 * 4 = 12\n#### 1,200", answer="1200")) == 1.0
    assert em(_rollout("#### 1,201", answer="1200")) == 0.0
    after = R.exact_match("after_answer", correct=2.0, wrong=-1.0)
    assert after(_rollout("I think 5. answer: 7", answer=7)) == 2.0
    assert after(_rollout("I think 7", answer=7)) == -1.0


# ----------------------------------------------------------------------------- math-verify

def test_math_verify_equivalences():
    mv = R.math_verify_reward()
    assert mv(_rollout(r"so $\boxed{0.5}$", answer=r"\frac{1}{2}")) == 1.0
    assert mv(_rollout(r"The answer is \boxed{\frac{1}{2}}", answer="1/2")) == 1.0
    assert mv(_rollout(r"$\boxed{(x+1)^2}$", answer="x^2+2x+1")) == 1.0  # bare LaTeX reference
    assert mv(_rollout(r"\boxed{1,234}", answer=1234)) == 1.0
    assert mv(_rollout("The answer is 4", answer="3")) == 0.0
    assert mv(_rollout("no idea", answer="3")) == 0.0
    scores = R.math_verify_reward(correct=1.0, wrong=-0.5)
    assert scores(_rollout("The answer is 4", answer="3")) == -0.5


def test_math_verify_with_parser_reads_after_thinking():
    text = r"<think>maybe \boxed{3}</think> The answer is \boxed{4}"
    assert R.math_verify_reward(parser="after_thinking")(_rollout(text, answer="4")) == 1.0
    unclosed = r"<think>maybe \boxed{4}"  # truncated thinking: no answer
    assert R.math_verify_reward(parser="after_thinking")(_rollout(unclosed, answer="4")) == 0.0


def test_math_verify_errors_name_the_rollout():
    mv = R.math_verify_reward()
    with pytest.raises(R.RewardError, match=r"math_verify_reward raised on rollout e0/i0/s4: ValueError: "
                                            r"rollout e0/i0/s4 has no reference answer"):
        R.score_rollout(_rollout("1", uid="e0/i0/s4"), mv)
    with pytest.raises(R.RewardError, match=r"rollout e0/i0/s5: .*cannot parse the reference answer ''"):
        R.score_rollout(_rollout("1", answer="", uid="e0/i0/s5"), mv)


def test_math_verify_outside_the_main_thread():
    """The default (no signal-based timeout) works in any thread; math-verify's timeout does not."""
    results = {}

    def score(key, fn):
        try:
            results[key] = R.score_rollout(_rollout(r"\boxed{0.5}", answer=r"\frac{1}{2}"), fn).reward
        except R.RewardError as e:
            results[key] = e

    for key, fn in [("default", R.math_verify_reward()), ("alarm", R.math_verify_reward(timeout_seconds=5))]:
        t = threading.Thread(target=score, args=(key, fn))
        t.start()
        t.join()
    assert results["default"] == 1.0
    assert isinstance(results["alarm"], R.RewardError) and "thread" in str(results["alarm"])


# ----------------------------------------------------------------------------- build_reward

def test_build_one_reward_is_scalar():
    fn, agg, names = build_reward([RewardSpec("exact_match", kwargs={"parser": "gsm8k"})])
    assert agg is None and names == ("exact_match",)
    scored = R.score_rollout(_rollout("#### 1,000", answer="1000"), fn, agg)
    assert scored.reward == 1.0 and scored.reward_vector is None
    fn2, _, _ = build_reward([RewardSpec("length_window", weight=0.5, kwargs={"min_tokens": 1, "max_tokens": 4})])
    assert R.score_rollout(_rollout(n_tokens=3), fn2).reward == 0.5


def test_build_several_rewards_is_a_weighted_vector(user_module):
    specs = [RewardSpec("exact_match", weight=1.0, kwargs={"parser": "last_number"}),
             RewardSpec("regex_format", weight=0.5, kwargs={"pattern": r".*= \d+"}),
             RewardSpec("length_window", weight=-2.0, kwargs={"min_tokens": 5, "max_tokens": 10}, label="long"),
             RewardSpec(f"{user_module}:has_word", weight=0.25, kwargs={"word": "2"})]
    fn, agg, names = build_reward(specs)
    assert names == ("exact_match", "regex_format", "long", "has_word")
    scored = R.score_rollout(_rollout("1 + 1 = 2", n_tokens=3, answer="2"), fn, agg)
    assert scored.reward_vector.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert scored.reward == pytest.approx(1.0 + 0.5 + 0.0 + 0.25)
    scored = R.score_rollout(_rollout("1 + 1 is 3", n_tokens=6, answer="2"), fn, agg)
    assert scored.reward_vector.tolist() == [0.0, 0.0, 1.0, 0.0] and scored.reward == pytest.approx(-2.0)


def test_build_other_builtins():
    fn, agg, names = build_reward([RewardSpec("tool_usage", kwargs={"per_success": 0.25}),
                                   RewardSpec("math_verify", weight=2.0, kwargs={"parser": "boxed"})])
    assert names == ("tool_usage", "math_verify")
    scored = R.score_rollout(_rollout(r"so \boxed{\frac{4}{2}}", answer="2"), fn, agg)
    assert scored.reward_vector.tolist() == [0.0, 1.0] and scored.reward == 2.0
    http, _, names = build_reward([RewardSpec("http", kwargs={"url": "http://scorer.test/score", "retries": 0})])
    assert names == ("http",) and R._fn_name(http) == "http_reward(http://scorer.test/score)"


def test_with_weights_one_per_reward():
    specs = [RewardSpec("exact_match"), RewardSpec("tool_usage")]
    assert [s.weight for s in R.with_weights(specs, [0.7, 0.3])] == [0.7, 0.3]
    with pytest.raises(ValueError, match=r"3 reward weights \[1, 2, 3\] given for 2 rewards "
                                         r"\(exact_match, tool_usage\); give one weight per reward"):
        R.with_weights(specs, [1, 2, 3])


@pytest.mark.parametrize("specs, message", [
    ([RewardSpec("exact_matc")], r"unknown reward 'exact_matc'; did you mean 'exact_match'\? Valid rewards: "
                                 r"exact_match, math_verify, regex_format, length_window, keywords, tool_usage, "
                                 r"reward_model, http; or a user function as module:function"),
    ([RewardSpec("bleu")], r"unknown reward 'bleu'\. Valid rewards: exact_match, .*module:function"),
    ([RewardSpec("length_window", kwargs={"min_tokens": 1, "max_token": 4})],
     r"reward 'length_window': unknown argument 'max_token'; did you mean 'max_tokens'\? "
     r"accepted arguments: min_tokens, max_tokens, reward=1.0"),
    ([RewardSpec("regex_format")], r"reward 'regex_format': missing a required argument: 'pattern'; "
                                   r"accepted arguments: pattern, reward=1.0, flags="),
    ([RewardSpec("regex_format", kwargs={"pattern": "(unclosed"})], r"reward 'regex_format' with .*missing \)"),
    ([RewardSpec("length_window", kwargs={"min_tokens": 5, "max_tokens": 2})],
     r"reward 'length_window' .*length window \[5, 2\] is empty"),
    ([RewardSpec("exact_match", kwargs={"parser": "boxd"})], r"unknown answer parser 'boxd'; did you mean 'boxed'"),
    ([RewardSpec("exact_match", kwargs=["gsm8k"])], r"reward 'exact_match': kwargs must be a dict"),
    ([RewardSpec("http", kwargs={"url": "scorer.test"})], r"reward 'http' .*must start with http:// or https://"),
    ([RewardSpec("http", kwargs={"url": "http://a", "retries": -1})], r"retries an int >= 0"),
    ([RewardSpec("nowhere_mod:score")], r"reward function 'nowhere_mod:score' cannot be loaded: .*"
                                        r"cannot import 'nowhere_mod'"),
    ([RewardSpec("primitives.env.rewards:no_such_fn")], r"'primitives.env.rewards' has no callable 'no_such_fn'"),
    ([RewardSpec("exact_match"), RewardSpec("exact_match", kwargs={"parser": "boxed"})],
     r"two rewards are logged as exact_match; give each RewardSpec a distinct label="),
    ([RewardSpec("exact_match", label="mean")], r"reward label 'mean' cannot name a reward/<label> metric"),
    ([RewardSpec("exact_match", weight=float("nan"))], r"reward 'exact_match' has weight nan; a weight is a finite"),
    ([RewardSpec("exact_match", weight="1")], r"has weight '1'"),
    ([RewardSpec("exact_match", weight=0), RewardSpec("tool_usage", weight=0.0)], r"all reward weights are 0"),
    ([], r"no rewards given"),
    (RewardSpec("exact_match"), r"got one: pass \[RewardSpec"),
    (["exact_match"], r"takes RewardSpec records, got 'exact_match'"),
])
def test_build_reward_errors_are_named(specs, message):
    with pytest.raises(ValueError, match=message):
        build_reward(specs)


def test_user_function_kwargs_are_checked(user_module):
    with pytest.raises(ValueError, match=r"reward function 'spec_test_rewards:has_word': unknown argument 'wrd'; "
                                         r"did you mean 'word'\? accepted arguments: word='yes'"):
        build_reward([RewardSpec(f"{user_module}:has_word", kwargs={"wrd": "x"})])
    with pytest.raises(ValueError, match=r"unknown argument 'rollout'; accepted arguments: word='yes'"):
        build_reward([RewardSpec(f"{user_module}:has_word", kwargs={"rollout": "x"})])


def test_user_function_from_a_file_path(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_MODULE)
    fn, _, names = build_reward([RewardSpec(f"{path}:has_word")])
    assert names == ("has_word",) and fn(_rollout("yes")) == 1.0 and fn(_rollout("no")) == 0.0


# ----------------------------------------------------------------------------- failures name rollout and function

def test_user_reward_failure_names_uid_and_function(user_module):
    fn, agg, _ = build_reward([RewardSpec("exact_match"), RewardSpec(f"{user_module}:broken")])
    with pytest.raises(R.RewardError, match=r"reward function spec_test_rewards:broken raised on rollout e1/i2/s3: "
                                            r"KeyError: 'oops'"):
        R.score_rollout(_rollout("1", answer="1", uid="e1/i2/s3"), fn, agg)
    fn, agg, _ = build_reward([RewardSpec(f"{user_module}:nan_reward")])
    with pytest.raises(R.RewardError, match=r"reward function spec_test_rewards:nan_reward returned nan "
                                            r"for rollout e1/i2/s4"):
        R.score_rollout(_rollout("1", uid="e1/i2/s4"), fn, agg)


def test_builtin_reward_failure_names_uid_and_function():
    fn, agg, _ = build_reward([RewardSpec("exact_match", kwargs={"parser": "gsm8k"}), RewardSpec("tool_usage")])
    with pytest.raises(R.RewardError, match=r"reward function exact_match_reward\(parse_gsm8k\) raised on rollout "
                                            r"e0/i0/s9: ValueError: rollout e0/i0/s9 has no reference answer"):
        R.score_rollout(_rollout("#### 1", uid="e0/i0/s9"), fn, agg)
    fn, agg, _ = build_reward([RewardSpec("length_window", kwargs={"min_tokens": 0, "max_tokens": 9,
                                                                  "reward": float("nan")})])
    with pytest.raises(R.RewardError, match=r"length_window_reward\(0, 9\) returned nan for rollout e0/i0/s8"):
        R.score_rollout(_rollout(uid="e0/i0/s8"), fn, agg)


# ----------------------------------------------------------------------------- reward model by path

def _save_tiny_rm(path, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_reward_model_spec_loads_lazily(tmp_path, tokenizer, monkeypatch):
    _save_tiny_rm(tmp_path, tokenizer)
    loads = []
    real_load = R.load_reward_model
    monkeypatch.setattr(R, "load_reward_model", lambda *a: loads.append(a) or real_load(*a))
    fn, agg, names = build_reward([RewardSpec("reward_model", kwargs={"path": str(tmp_path)})])
    assert loads == [] and names == ("reward_model",)  # nothing loaded at build time (the driver)
    model, tok = real_load(str(tmp_path))
    expected = R.reward_model_scores(model, tok, ["p1+1=2"])[0]  # default render: prompt + completion
    assert fn(_rollout("1+1=2")) == pytest.approx(float(expected), abs=1e-5)
    fn(_rollout("2+2=4"))
    assert loads == [(str(tmp_path), "cpu")]  # loaded once, on the first call


def test_reward_model_spec_checks_the_directory(tmp_path):
    with pytest.raises(ValueError, match=r"reward 'reward_model' .*reward model path '.*nope' is not a directory"):
        build_reward([RewardSpec("reward_model", kwargs={"path": str(tmp_path / "nope")})])
    with pytest.raises(ValueError, match=r"has no config.json"):
        build_reward([RewardSpec("reward_model", kwargs={"path": str(tmp_path)})])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no tokenizer \(none of tokenizer.json"):
        build_reward([RewardSpec("reward_model", kwargs={"path": str(tmp_path)})])
    with pytest.raises(ValueError, match=r"reward 'reward_model': missing a required argument: 'path'; "
                                         r"accepted arguments: path, device='cpu'"):
        build_reward([RewardSpec("reward_model")])


# ----------------------------------------------------------------------------- per-component logging

def _scored_batch(texts_answers, fn, agg):
    rollouts = [R.score_rollout(_rollout(t, answer=a, uid=f"e0/i0/s{k}"), fn, agg)
                for k, (t, a) in enumerate(texts_answers)]
    return make_batch(rollouts, AlgorithmConfig(), pad_id=0)


def test_rollout_metrics_logs_each_component():
    fn, agg, names = build_reward([RewardSpec("exact_match", weight=0.8),
                                   RewardSpec("regex_format", weight=0.2, kwargs={"pattern": r"\d+"}, label="fmt")])
    batch = _scored_batch([("7", "7"), ("x 7", "7"), ("8", "7")], fn, agg)
    # vectors: [1, 1], [1, 0], [0, 1]; rewards 1.0, 0.8, 0.2
    m = rollout_metrics(batch, names)
    assert m["reward/exact_match"] == pytest.approx(2 / 3) and m["reward/fmt"] == pytest.approx(2 / 3)
    assert m["reward/mean"] == pytest.approx(2 / 3) and m["reward/max"] == pytest.approx(1.0)
    assert m["reward/min"] == pytest.approx(0.2)
    plain = rollout_metrics(batch)
    assert plain["reward/component_0"] == pytest.approx(2 / 3) and "reward/fmt" not in plain
    with pytest.raises(ValueError, match=r"rollouts carry 2 reward components, 1 names given"):
        rollout_metrics(batch, ["exact_match"])
    with pytest.raises(ValueError, match=r"repeat or clash"):
        rollout_metrics(batch, ["mean", "fmt"])


def test_rollout_metrics_without_vectors_keeps_its_keys():
    fn, agg, names = build_reward([RewardSpec("exact_match")])
    batch = _scored_batch([("7", "7"), ("8", "7")], fn, agg)
    m = rollout_metrics(batch, names)
    assert set(m) == {"reward/mean", "reward/std", "reward/min", "reward/max", "response/len_mean",
                      "response/len_max", "response/truncated_frac", "batch/rows", "batch/loss_tokens"}
    assert m == rollout_metrics(batch) and m["reward/mean"] == 0.5 and m["reward/std"] == 0.5
