"""Two simulated nodes (ray.cluster_utils.Cluster): each role lands where its custom resource
is, training runs across nodes, and the generator pool scales on its own (1 and 3); a result
that lives on another node is waited for and fetched, never mistaken for a silent actor."""
import functools
import os
import pickle

import pytest

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
from rl_actors.common import environ
from rl_actors.trainer import TrainerConfig
from tests.conftest import ROOT

pytestmark = pytest.mark.ray  # a simulated cluster of its own


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    with environ({"PYTHONPATH": ROOT}):  # the nodes' workers import this module's functions
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        gen_node = cluster.add_node(num_cpus=5, resources={"generator_node": 1})
        trainer_node = cluster.add_node(num_cpus=4, resources={"trainer_node": 1})
        cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield {"generator": gen_node.node_id, "trainer": trainer_node.node_id}
    ray.shutdown()
    cluster.shutdown()


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
