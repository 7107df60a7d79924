"""Filters and pair selectors on hand-made groups."""
import numpy as np
import pytest

from primitives.maths.filters import (
    all_pairs,
    by_group,
    create_random_pairs,
    dynamic_sampling_filter,
    overlong_filter,
    select_pairs,
    top_bottom_pairs,
)
from primitives.types import Rollout


def _r(group, k, reward, finish="stop"):
    return Rollout(f"{group}/s{k}", group, "p", np.array([1]), np.array([2]), np.ones(1, np.float32),
                   np.zeros(1, np.float32), finish_reason=finish, reward=reward)


ROLLOUTS = [_r("a", 0, 1.0), _r("b", 0, 0.0), _r("a", 1, 0.0), _r("b", 1, 0.0), _r("c", 0, 0.5, "length"),
            _r("c", 1, 0.2), _r("c", 2, 0.9)]


def test_by_group_keeps_first_seen_order():
    assert [(g, [r.uid for r in rs]) for g, rs in by_group(ROLLOUTS).items()] == [
        ("a", ["a/s0", "a/s1"]), ("b", ["b/s0", "b/s1"]), ("c", ["c/s0", "c/s1", "c/s2"])]


def test_dynamic_sampling_drops_uniform_groups():
    assert [r.uid for r in dynamic_sampling_filter(ROLLOUTS)] == ["a/s0", "a/s1", "c/s0", "c/s1", "c/s2"]
    assert [r.group for r in dynamic_sampling_filter(ROLLOUTS, tol=0.6)] == ["a", "a", "c", "c", "c"]
    assert dynamic_sampling_filter(ROLLOUTS, tol=1.0) == []
    with pytest.raises(ValueError, match="has no reward yet"):
        dynamic_sampling_filter([ROLLOUTS[0]._replace(reward=None)])


def test_overlong_filter():
    assert [r.uid for r in overlong_filter(ROLLOUTS)] == [r.uid for r in ROLLOUTS if r.uid != "c/s0"]


def test_pair_selectors():
    c = by_group(ROLLOUTS)["c"]
    assert [(a.uid, b.uid) for a, b in top_bottom_pairs(c)] == [("c/s2", "c/s1")]
    assert top_bottom_pairs(by_group(ROLLOUTS)["b"]) == []  # a tie gives no pair
    assert sorted((a.uid, b.uid) for a, b in all_pairs(c)) == [("c/s0", "c/s1"), ("c/s2", "c/s0"), ("c/s2", "c/s1")]
    picked = create_random_pairs(2, seed=0)(c)
    assert len(picked) == 2 and all(a.reward > b.reward for a, b in picked)
    assert create_random_pairs(2, seed=0)(c) == picked  # seeded
    pairs = select_pairs(ROLLOUTS, top_bottom_pairs)
    assert [(a.uid, b.uid) for a, b in pairs] == [("a/s0", "a/s1"), ("c/s2", "c/s1")]
