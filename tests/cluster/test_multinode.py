"""Two simulated nodes (ray.cluster_utils.Cluster): each role lands where its custom resource
is, training runs across nodes, and the generator pool scales on its own (1 and 3)."""
import pytest

from cluster.loop.train import RLRun, train
from cluster.ray_wing.backend import RayBackend, sync_weights
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.groups import fan_out, gather
from cluster.ray_wing.roles import build_rl_cluster, shutdown_cluster
from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
from primitives.io.data import make_prompt_source
from primitives.maths.algorithms import constant_schedule, grpo
from primitives.types import GenerationConfig
from rl_actors.trainer import TrainerConfig

pytestmark = pytest.mark.ray  # a simulated cluster of its own


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
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
