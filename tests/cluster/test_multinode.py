"""Two simulated nodes (ray.cluster_utils.Cluster): each role lands where its custom resource
is, training runs across nodes, and the generator pool scales on its own (1 and 3); a result
that lives on another node is waited for and fetched, never mistaken for a silent actor."""
import functools
import os
import pickle

import pytest

from cluster.loop.protocol import ActorFailure
from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from cluster.ray_wing.weights import sync_weights
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig
from tests.chaos import FAST_HEALTH_CHECKS, Nodes

# a simulated cluster of its own; apart: nodes started and lost, and losses waited for
pytestmark = [pytest.mark.ray, pytest.mark.own_ray, pytest.mark.apart]


@pytest.fixture(scope="module")
def nodes():
    # and the head, the driver's node; a lost node is seen in 5 s, not 15 (the chaos test keeps Ray's defaults)
    nodes = Nodes({"generator": 5, "trainer": 4}, health_checks=FAST_HEALTH_CHECKS)
    yield nodes
    nodes.shutdown()


@pytest.fixture(scope="module")
def two_nodes(nodes):
    return {"generator": nodes.node_id("generator"), "trainer": nodes.node_id("trainer")}


@pytest.mark.parametrize("generators", [1, 3])
def test_roles_land_on_their_nodes_and_train(two_nodes, tiny_model_path, generators):
    cfg = ClusterConfig(generators=generators, trainers=2, zero_stage=2, call_timeout_s=300, pin_roles=True)
    rl = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=1e-3), arithmetic_reward,
                          with_reference=True)
    try:
        groups = (rl.generators.group, rl.trainers, rl.rewards, rl.reference.group)
        where = {g.role: set() for g in groups}
        for group in groups:
            for info in gather(fan_out(group, "info"), rl.timeout_s):
                where[info["role"]].add(info["node_id"])
        assert where["generator"] == {two_nodes["generator"]} and where["reward"] == {two_nodes["generator"]}
        assert where["trainer"] == {two_nodes["trainer"]} and where["reference"] == {two_nodes["trainer"]}
        assert rl.generators.size == generators

        items = make_arithmetic_task(ArithmeticTaskSpec(num_train=32, num_heldout=1))[0]
        sync_weights(rl, version=0)
        state = train(RayBackend(rl), make_prompt_source(items), constant_schedule(grpo(kl_coef=0.01)),
                      RLRun(GenerationConfig(max_new_tokens=4, n=4), num_steps=2, prompts_per_step=6,
                            lr_schedule=lambda s: 1e-3, progress=False))
        assert state.policy_version == 2 and len(state.metrics_history) == 2
        assert state.metrics_history[-1]["batch/rows"] == 24  # 6 prompts x 4, split over the generators
        trainer = gather(fan_out(rl.trainers, "weight_checksums"), rl.timeout_s)[0]
        for sums in gather(fan_out(rl.generators.group, "weight_checksums"), rl.timeout_s):
            assert sums == trainer  # weights crossed from the trainer node to the generator node
    finally:
        shutdown_cluster(rl)


def _exits_once(flag: str, rollout) -> float:
    """A reward whose worker process exits the first time it scores (``flag`` remembers it across
    the replacement), as a reward worker killed mid-collection does."""
    if not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(1)
    return arithmetic_reward(rollout)


def test_a_reward_worker_dying_beside_chunks_on_another_node_is_replaced(two_nodes, tiny_model_path, tmp_path):
    """The driver is on the head node; the generator's chunks (well over Ray's 100 KB inline limit)
    stay in the generator node's object store. The reward worker dies scoring them: the failure is
    named by the reward worker (not by the generator whose finished result is simply not local), the
    worker is replaced and the run ends its steps. Before the fix, the driver's zero-timeout get of
    the remote chunk failed as "generator 0.generate: no answer within 0s" and the run ended."""
    import ray

    reward = functools.partial(_exits_once, str(tmp_path / "reward_exited"))
    cfg = ClusterConfig(generators=1, trainers=1, zero_stage=2, call_timeout_s=300, pin_roles=True)
    rl = build_rl_cluster(tiny_model_path, cfg, TrainerConfig(zero_stage=2, lr=1e-3, micro_batch_size=64), reward,
                          with_reference=False)
    backend = RayBackend(rl, max_actor_restarts=2)
    try:
        items = make_arithmetic_task(ArithmeticTaskSpec(num_train=200, num_heldout=1))[0]
        gen = GenerationConfig(max_new_tokens=4, n=8)
        chunk = gather([rl.generators.generate(0, items[:100], gen)], rl.timeout_s)[0]
        assert len(pickle.dumps(chunk)) > 150_000  # 800 rollouts: stored in the object store, not inline
        assert ray.get_runtime_context().get_node_id() not in (two_nodes["generator"], two_nodes["trainer"])
        sync_weights(rl, version=0)
        state = train(backend, make_prompt_source(items), constant_schedule(grpo(kl_coef=0.0)),
                      RLRun(gen, num_steps=2, prompts_per_step=100, lr_schedule=lambda s: 1e-3, progress=False))
        assert state.policy_version == 2 and state.metrics_history[-1]["batch/rows"] == 800
        assert [f["role"] for f in backend.faults] == ["reward"], backend.faults
        assert state.metrics_history[-1]["faults/restarts/reward"] == 1.0
    finally:
        shutdown_cluster(backend.cluster)


class _Maker:
    """Makes arrays on its node and reads those of others."""

    def make(self, n: int):
        import numpy as np

        return np.arange(n, dtype=np.float32)

    def total(self, x) -> float:
        return float(x.sum())


def test_a_result_lost_with_its_node_names_its_maker_and_a_kept_copy_survives(nodes):
    """A spare node joins, an actor there makes four 400 KB arrays (object store, not inline), and
    the node is lost. The driver's own read of a lost result, another node's call that reads one,
    and a copy started too late all fail as the death of the actor that made it (its id from the
    object's), so recovery replaces that actor rather than blaming the reader or calling it a user
    error; the array ``keep_here`` copied to the driver's node before the loss is still there,
    whole, and an object stored on the driver's node alone is not copied."""
    import numpy as np
    import ray

    from cluster.ray_wing.custody import keep_here
    from cluster.ray_wing.groups import Call, actor_id

    nodes.groups["spare"] = 1
    nodes.add("spare")
    maker = ray.remote(_Maker).options(resources={"spare_node": 0.1}, max_restarts=0).remote()
    reader = ray.remote(_Maker).options(resources={"generator_node": 0.01}, max_restarts=0).remote()
    made = [Call(maker.make.remote(100_000), "generator", 0, "make", actor_id(maker)) for _ in range(4)]
    ray.wait([c.ref for c in made], num_returns=4, timeout=120, fetch_local=False)  # done, on the spare node alone
    kept, copied = keep_here([made[0].ref, None], [made[0], made[0]], 60)
    assert kept[1] is None and kept[0] != made[0].ref and copied >= 400_000
    same, nothing = keep_here([kept[0]], [made[0]], 60)
    assert same == [kept[0]] and nothing == 0  # a copy on the driver's node is not copied again
    own = ray.put(np.ones(100_000, np.float32))  # the driver's own (as on one node): stays
    assert keep_here([own], [made[0]], 60) == ([own], 0)

    nodes.remove("spare")
    with pytest.raises(ActorFailure) as copying:  # too late to keep one: its maker is named
        keep_here([made[3].ref], [made[3]], 60)
    assert copying.value.died and copying.value.actor_id == actor_id(maker)
    with pytest.raises(ActorFailure) as own:
        gather([made[1]], 60)
    assert own.value.died and own.value.actor_id == actor_id(maker) and "lost with the node" in str(own.value)
    read = Call(reader.total.remote(made[2].ref), "reward", 0, "total", actor_id(reader))
    with pytest.raises(ActorFailure) as other:
        gather([read], 60)
    assert other.value.died and other.value.replaceable and other.value.actor_id == actor_id(maker)
    assert other.value.role == "reward" and "lost with the node" in str(other.value)
    assert np.array_equal(ray.get(kept[0]), np.arange(100_000, dtype=np.float32))
    ray.kill(reader)
