"""What the Ray backend passes to the actors, checked with stand-in actors that report what
they were given: the policy's scheduled learning rate reaches the trainer ranks only; the
critic ranks train at their own (``algorithm.critic_lr``, set when the group is built)."""

from cluster.ray_wing.backend import RayBackend
from cluster.ray_wing.groups import WorkerGroup
from cluster.ray_wing.roles import RLCluster
from primitives.types import BatchPlan


class LrReporter:
    """A trainer or critic rank that reports the learning rate its update would use: the one
    passed in, else its own."""

    def __init__(self, own_lr: float):
        self.own_lr = own_lr

    def train_planned(self, plan, algo, temperature, lr, num_parts, *resolved):
        return [{"lr": self.own_lr if lr is None else lr, "rows": len(plan.rows)}], {}

    def value_step_planned(self, plan, algo, num_parts, *resolved):
        return [{"critic/lr": self.own_lr, "rows": len(plan.rows)}]


def _plan(rows: int) -> BatchPlan:
    return BatchPlan(tuple((0, i) for i in range(rows)), pad_token_id=0)


def _group(ray, role, own_lr, size):
    remote = ray.remote(num_cpus=0)(LrReporter)
    return WorkerGroup(role, tuple(remote.remote(own_lr) for _ in range(size)))


def test_the_critic_trains_at_its_own_learning_rate(ray_local):
    cluster = RLCluster(generators=None, trainers=_group(ray_local, "trainer", 1e-5, 2), rewards=None,
                        reference=None, sync_address=None, weight_meta=(), pad_token_id=0, bucket_bytes=0,
                        timeout_s=60, ray_address="",
                        critics=_group(ray_local, "critic", 3e-4, 2))
    try:
        policy, critic, _ = RayBackend(cluster).train_step(_plan(3), [], None, None, 1.0, lr=2e-6, with_critic=True)
        assert [u[0]["lr"] for u in policy] == [2e-6, 2e-6]  # the schedule's rate, on every rank
        assert [u[0]["critic/lr"] for u in critic] == [3e-4, 3e-4]  # the critic's own, not the policy's
        assert [u[0]["rows"] for u in policy + critic] == [3] * 4  # every rank gets the whole batch
        assert RayBackend(cluster).train_step(_plan(1), [], None, None, 1.0, lr=None, with_critic=False).critic is None
    finally:  # an idle actor left for the rest of the run still costs its process's upkeep (4 CPU-s each here)
        for actor in cluster.trainers.actors + cluster.critics.actors:
            ray_local.kill(actor)
