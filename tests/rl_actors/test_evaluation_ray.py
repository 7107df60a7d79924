"""``cluster.loop.train.evaluate`` on Ray: k samples per item drawn on the generators, scored on the
reward worker; the returned metrics are ``eval_metrics`` of exactly what the JSONL holds."""
import json
from collections import Counter

import numpy as np
import pytest

from cluster.loop.evaluate import evaluate
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.fixtures.tasks import ArithmeticTaskSpec, make_arithmetic_task
from primitives.io.evaluation import eval_metrics
from primitives.types import GenerationConfig, Rollout
from rl_actors.trainer import TrainerConfig
from tests.rewards import parity_reward

K = 3


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_path):
    cfg = ClusterConfig(generators=1, trainers=1, zero_stage=2, call_timeout_s=300)
    c = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2), parity_reward, with_reference=False)
    yield c
    shutdown_cluster(c)


@pytest.fixture(scope="module")
def items():
    return make_arithmetic_task(ArithmeticTaskSpec(num_train=1, num_heldout=8, seed=3))[1]


def from_records(records) -> list:
    """Scored rollouts rebuilt from sample records: what eval_metrics needs (uid, group, reward)."""
    empty = np.zeros(0, dtype=np.int64)
    return [Rollout(uid=r["uid"], group=r["group"], prompt=r["prompt"], prompt_ids=empty, completion_ids=empty,
                    loss_mask=empty.astype(np.float32), logprobs=empty.astype(np.float32), reward=r["reward"])
            for r in records]


def test_evaluate_returns_eval_metrics_of_the_written_samples(cluster, items, tmp_path):
    path = tmp_path / "samples" / "step_5.jsonl"
    gen = GenerationConfig(max_new_tokens=4, temperature=1.0, n=1)  # n is replaced by k
    metrics = evaluate(RayBackend(cluster), items, gen, k=K, samples_path=str(path), step=5)
    records = [json.loads(line) for line in open(path)]
    assert len(records) == K * len(items)
    assert Counter(r["group"] for r in records) == {f"e0/i{it.index}": K for it in items}
    assert {r["uid"] for r in records} == {f"e0/i{it.index}/s{s}" for it in items for s in range(K)}
    assert {r["step"] for r in records} == {5}
    answers = {f"e0/i{it.index}": it.answer for it in items}
    prompts = {f"e0/i{it.index}": it.prompt for it in items}
    for r in records:
        assert r["answer"] == answers[r["group"]] and r["prompt"] == prompts[r["group"]]
        assert r["reward"] in (0.0, 1.0) and r["finish_reason"] in ("stop", "length")
        assert r["reward_components"] is None and isinstance(r["completion"], str)
    assert metrics == eval_metrics(from_records(records), k=K, correct_threshold=1.0)  # exactly, not approximately
    assert set(metrics) == {"eval/reward_mean", "eval/accuracy", "eval/pass@1", f"eval/pass@{K}"}
    assert 0.0 < metrics["eval/accuracy"] < 1.0  # the reward varies, so the check above is not vacuous
    assert metrics["eval/pass@1"] == pytest.approx(metrics["eval/accuracy"], abs=1e-12)  # equal group sizes
    assert metrics[f"eval/pass@{K}"] >= metrics["eval/pass@1"]
    # with n = k samples, pass@k is the share of items with at least one correct sample
    any_correct = {g for g in answers if any(r["reward"] >= 1.0 for r in records if r["group"] == g)}
    assert metrics[f"eval/pass@{K}"] == pytest.approx(len(any_correct) / len(items), abs=1e-12)


def test_greedy_k1_is_the_share_of_correct_samples_and_pass_at_k_needs_a_temperature(cluster, items, tmp_path):
    greedy = GenerationConfig(max_new_tokens=4, temperature=0.0)
    path = tmp_path / "greedy.jsonl"
    m = evaluate(RayBackend(cluster), items, greedy, k=1, samples_path=str(path))
    records = [json.loads(line) for line in open(path)]
    assert len(records) == len(items)
    assert m["eval/accuracy"] == sum(r["reward"] >= 1.0 for r in records) / len(items)
    assert m["eval/pass@1"] == m["eval/accuracy"]
    with pytest.raises(ValueError, match="needs temperature > 0"):
        evaluate(RayBackend(cluster), items, greedy, k=2)
    with pytest.raises(ValueError, match="no evaluation items"):
        evaluate(RayBackend(cluster), [], greedy, k=1)
