"""Which groups the driver keeps for its next cluster (``cluster.ray_wing.pool``), without Ray: a
whole group of a kept role in its own placement group; not one that shrank, grew or was repaired
into placement groups of its own, nor a critic group; shapes tell a generator's engines apart."""
from typing import NamedTuple

import pytest

from cluster.ray_wing.groups import WorkerGroup, group_shape
from cluster.ray_wing.placement import RoleSpec
from cluster.ray_wing.pool import REUSE_ENV, keepable, reuse_enabled
from rl_actors.critic import CriticWorker
from rl_actors.generator import GeneratorWorker
from rl_actors.reward import RewardWorker
from rl_actors.trainer import TrainerWorker


class Bundles(NamedTuple):
    bundle_count: int


def group(cls, role: str, count: int, actors: int, slots: tuple = (), variant: str = "") -> WorkerGroup:
    spec = RoleSpec(role, count)
    return WorkerGroup(role, tuple(f"{role}{r}" for r in range(actors)), Bundles(count), slots,
                       group_shape(cls, spec, variant))


def test_a_whole_group_of_a_kept_role_is_keepable():
    assert keepable(group(TrainerWorker, "trainer", 2, 2))
    assert keepable(group(GeneratorWorker, "generator", 3, 3))
    assert keepable(group(RewardWorker, "reward", 1, 1))


@pytest.mark.parametrize("made", [
    lambda: group(GeneratorWorker, "generator", 3, 2),  # shrunk 3 -> 2: its bundles say 3
    lambda: group(GeneratorWorker, "generator", 2, 3, slots=(None, None, ("pg", 0))),  # grown into a group of its own
    lambda: group(CriticWorker, "critic", 2, 2),  # critics start after the other roles: never kept
    lambda: WorkerGroup("trainer", ("t0",), Bundles(1)),  # no shape: not made by create_group
], ids=["shrunk", "grown", "critic", "no-shape"])
def test_other_groups_are_not_kept(made):
    assert not keepable(made())


def test_shapes_differ_by_class_role_count_bundle_and_engine():
    trainer = group_shape(TrainerWorker, RoleSpec("trainer", 2))
    assert trainer == group_shape(TrainerWorker, RoleSpec("trainer", 2))
    others = [group_shape(TrainerWorker, RoleSpec("trainer", 3)),
              group_shape(TrainerWorker, RoleSpec("trainer", 2, num_cpus=2.0)),
              group_shape(TrainerWorker, RoleSpec("trainer", 2, strategy="SPREAD")),
              group_shape(GeneratorWorker, RoleSpec("trainer", 2)),
              group_shape(TrainerWorker, RoleSpec("trainer", 2), variant="vllm")]
    assert all(o != trainer for o in others) and len(set(others)) == len(others)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("yes", True), ("0", False), ("", False),
                                      ("no", False)])
def test_reuse_is_on_only_when_asked(monkeypatch, value, on):
    monkeypatch.setenv(REUSE_ENV, value)
    assert reuse_enabled() is on
