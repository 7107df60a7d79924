"""Which groups the driver keeps for its next cluster (``cluster.ray_wing.pool``), without Ray: a
whole group of a kept role in its own placement group; not one that shrank, grew or was repaired
into placement groups of its own; shapes tell a generator's engines apart. Which kept groups make
room for a new cluster's bundles, and how many actors may wait."""
from typing import NamedTuple

import pytest

from cluster.ray_wing.groups import WorkerGroup, group_shape
from cluster.ray_wing.placement import RoleSpec
from cluster.ray_wing.pool import (
    KEPT_MAX,
    KEPT_MAX_ENV,
    REUSE_ENV,
    fits,
    held,
    keepable,
    kept_max,
    reuse_enabled,
    to_free,
)
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
    assert keepable(group(CriticWorker, "critic", 2, 2))


@pytest.mark.parametrize("made", [
    lambda: group(GeneratorWorker, "generator", 3, 2),  # shrunk 3 -> 2: its bundles say 3
    lambda: group(GeneratorWorker, "generator", 2, 3, slots=(None, None, ("pg", 0))),  # grown into a group of its own
    lambda: WorkerGroup("trainer", ("t0",), Bundles(1)),  # no shape: not made by create_group
], ids=["shrunk", "grown", "no-shape"])
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


def test_held_resources_are_the_bundle_once_per_actor():
    shape = group_shape(TrainerWorker, RoleSpec("trainer", 3, num_cpus=2.0, resources={"trainer_node": 1}))
    assert held(shape) == {"CPU": 6.0, "trainer_node": 3}


@pytest.mark.parametrize("need,free,freed", [
    ({"CPU": 4.0}, {"CPU": 4.0}, []),  # room already: nothing goes
    ({"CPU": 4.0}, {"CPU": 3.0}, [0]),  # 3 + 2 of the oldest = 5
    ({"CPU": 4.0}, {"CPU": 1.5}, [0, 1]),  # 1.5 + 2 = 3.5 is short; + 1 = 4.5
    ({"CPU": 4.0, "GPU": 1.0}, {"CPU": 8.0}, [2]),  # CPU to spare: only the group that holds a GPU goes
    ({"CPU": 7.0, "GPU": 1.0}, {"CPU": 2.0}, [0, 1, 2]),  # 2 + 2 + 1 + 2 = 7 CPUs, the GPU with the third
    ({"CPU": 9.0}, {"CPU": 2.0}, [0, 1, 2, 3]),  # 2 + 6 = 8 is short even with every group: all go
    ({"CPU": 1.0, "GPU": 4.0}, {"CPU": 0.0}, [0, 1, 2, 3]),  # 4 GPUs are never there: every group goes
])
def test_the_oldest_kept_groups_holding_what_is_short_go_until_the_new_bundles_fit(need, free, freed):
    holding = [{"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}]
    assert to_free(holding, need, free) == freed
    assert to_free([], {}, {}) == [] and fits({}, {}) and not fits({"CPU": 1.0}, {})


@pytest.mark.parametrize("value,limit", [("", KEPT_MAX), ("0", 0), ("12", 12)])
def test_the_kept_actor_limit_is_read_from_the_environment(monkeypatch, value, limit):
    monkeypatch.setenv(KEPT_MAX_ENV, value)
    assert kept_max() == limit


def test_a_kept_actor_limit_that_is_no_count_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(KEPT_MAX_ENV, "many")
    with pytest.raises(ValueError, match="RAYRL_KEPT_MAX='many': give a whole number of actors"):
        kept_max()
