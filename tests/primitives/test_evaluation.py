"""pass@k (Chen et al. 2021), evaluation metrics and sample records, on hand-worked values."""
import json
from math import comb

import numpy as np
import pytest

from primitives.io.evaluation import (
    eval_metrics,
    mean_pass_at_k,
    pass_at_k,
    render_prompt_text,
    sample_records,
    write_jsonl_atomic,
)
from primitives.types import Conversation, Message, Rollout


def rollout(group: int, sample: int, reward, vector=None, prompt="1+2=", text="3", answer="3", reason="stop"):
    ids = np.zeros(1, dtype=np.int64)
    return Rollout(uid=f"e0/i{group}/s{sample}", group=f"e0/i{group}", prompt=prompt, prompt_ids=ids,
                   completion_ids=ids, loss_mask=np.ones(1, np.float32), logprobs=np.zeros(1, np.float32),
                   finish_reason=reason, text=text, reward=reward, answer=answer,
                   reward_vector=None if vector is None else np.asarray(vector, np.float32))


def test_pass_at_k_hand_worked():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-12)  # pass@1 = c / n
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: pass iff any is correct


def test_pass_at_k_product_form_matches_binomials_and_stays_finite():
    for n, c, k in [(10, 3, 5), (20, 1, 7), (16, 8, 16), (7, 0, 3)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    # C(1000, 500) overflows a float; the product form does not
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    assert pass_at_k(1000, 2, 10) == pytest.approx(1 - 990 * 989 / (1000 * 999), abs=1e-12)  # 1 - C(998,10)/C(1000,10)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="k=5, n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="1 <= k"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="one sample count"):
        mean_pass_at_k([4, 4], [1], 2)


def test_mean_pass_at_k_averages_over_problems():
    # problems (n=4, c=1), (n=4, c=0), (n=2, c=2): pass@2 = (0.5 + 0 + 1) / 3
    assert mean_pass_at_k([4, 4, 2], [1, 0, 2], 2) == pytest.approx(0.5, abs=1e-12)


def test_eval_metrics_on_hand_made_rollouts():
    # group 0 rewards (1, 0, 0, 0): c=1; group 1 rewards (1, 1, 0.5, 0): c=2 with threshold 1
    rs = [rollout(0, s, r) for s, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    rs += [rollout(1, s, r) for s, r in enumerate([1.0, 1.0, 0.5, 0.0])]
    m = eval_metrics(rs, k=2, correct_threshold=1.0)
    assert m == pytest.approx({
        "eval/reward_mean": 3.5 / 8,
        "eval/accuracy": 3 / 8,
        "eval/pass@1": (1 / 4 + 2 / 4) / 2,
        "eval/pass@2": (0.5 + (1 - comb(2, 2) / comb(4, 2))) / 2,  # (0.5 + 5/6) / 2
    }, abs=1e-12)
    # a lower threshold counts the 0.5 as correct: group 1 has c=3
    m = eval_metrics(rs, k=2, correct_threshold=0.5)
    assert m["eval/accuracy"] == pytest.approx(4 / 8) and m["eval/pass@2"] == pytest.approx((0.5 + 1.0) / 2)


def test_eval_metrics_greedy_k1_is_accuracy_and_components_are_named():
    rs = [rollout(i, 0, r, vector=v) for i, (r, v) in enumerate([(1.0, [1, 0]), (0.2, [0, 1]), (0.0, [0, 0])])]
    m = eval_metrics(rs, k=1, correct_threshold=1.0, component_names=["exact", "format"])
    assert m == pytest.approx({"eval/reward_mean": 0.4, "eval/accuracy": 1 / 3, "eval/pass@1": 1 / 3,
                               "eval/reward/exact": 1 / 3, "eval/reward/format": 1 / 3}, abs=1e-7)
    unnamed = eval_metrics(rs, k=1)
    assert unnamed["eval/reward/component_0"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="2 reward components; 1 names"):
        eval_metrics(rs, k=1, component_names=["exact"])


def test_eval_metrics_rejects_unscored_duplicate_or_too_few_samples():
    with pytest.raises(ValueError, match="no reward, e.g. e0/i0/s0"):
        eval_metrics([rollout(0, 0, None)], k=1)
    with pytest.raises(ValueError, match="e0/i0/s0 appears twice"):
        eval_metrics([rollout(0, 0, 1.0), rollout(0, 0, 1.0)], k=1)
    with pytest.raises(ValueError, match="k=4, n=2"):
        eval_metrics([rollout(0, 0, 1.0), rollout(0, 1, 0.0)], k=4)
    with pytest.raises(ValueError, match="no rollouts"):
        eval_metrics([], k=1)


def test_sample_records_are_json_friendly_with_every_field(tmp_path):
    chat = Conversation((Message("system", "Be brief."), Message("user", "What is 1+2?")))
    rs = [rollout(0, 0, 1.0, vector=[1.0, 0.5], prompt=chat, answer=np.int64(3), text="3"),
          rollout(1, 0, 0.0, vector=[0.0, 1.0], text="4444", reason="length")]
    records = sample_records(rs, step=7, component_names=["exact", "format"])
    assert records[0] == {"step": 7, "uid": "e0/i0/s0", "group": "e0/i0",
                          "prompt": "system: Be brief.\nuser: What is 1+2?", "completion": "3", "answer": 3,
                          "reward": 1.0, "reward_components": {"exact": 1.0, "format": 0.5}, "finish_reason": "stop"}
    assert records[1]["prompt"] == "1+2=" and records[1]["finish_reason"] == "length"
    assert json.loads(json.dumps(records)) == records
    assert sample_records(rs, step=7, component_names=["exact", "format"], limit=1) == records[:1]
    assert sample_records(rs, step=7)[0]["reward_components"] == {"component_0": 1.0, "component_1": 0.5}
    assert sample_records([rollout(0, 0, 0.5)], step=0)[0]["reward_components"] is None
    path = write_jsonl_atomic(str(tmp_path / "samples" / "step_7.jsonl"), records)
    assert [json.loads(line) for line in open(path)] == records
    write_jsonl_atomic(path, records[:1])  # replaced, not appended; no temporary file left behind
    assert len(open(path).readlines()) == 1 and sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "step_7.jsonl"]


def test_render_prompt_text_refuses_other_types():
    assert render_prompt_text("2+2=") == "2+2="
    with pytest.raises(TypeError, match="got dict"):
        render_prompt_text({"role": "user"})
