"""What the Ray backend passes to the actors, checked with stand-in actors that report what
they were given: the policy's scheduled learning rate reaches the trainer ranks only; the
critic ranks train at their own (``algorithm.critic_lr``, set when the group is built)."""

from cluster.ray_wing.backend import RayBackend, RolloutRefs
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


def test_an_evaluation_is_scored_without_the_shaping_function(ray_local):
    """A real reward worker with a shaping function (reward - 0.25): the training collection's rewards
    are shaped, an evaluation's (``shaped=False``, as ``cluster.loop.evaluate`` asks) are the task's
    own. A length penalty counted right answers wrong, and a KL shaping raised, with no reference there."""
    import numpy as np

    from cluster.ray_wing.groups import Call
    from primitives.types import Rollout
    from rl_actors.reward import RewardWorker

    rollouts = [Rollout(uid=f"e0/i0/s{i}", group="e0/i0", prompt="p", prompt_ids=np.arange(3),
                        completion_ids=np.arange(2 + i), loss_mask=np.ones(2 + i, np.float32),
                        logprobs=np.zeros(2 + i, np.float32), finish_reason="stop") for i in range(3)]
    worker = ray_local.remote(num_cpus=0)(RewardWorker).remote(
        reward_fn=lambda r: float(len(r.completion_ids)), shaping_fn=lambda r, reward: reward - 0.25)
    cluster = RLCluster(generators=None, trainers=None, rewards=WorkerGroup("reward", (worker,)), reference=None,
                        sync_address=None, weight_meta=(), pad_token_id=0, bucket_bytes=0, timeout_s=60,
                        ray_address="")
    backend = RayBackend(cluster)
    try:
        generated = RolloutRefs((("generate", [Call(ray_local.put(rollouts), "generator", 0, "generate")]),))
        for shaped, expected in ((True, [1.75, 2.75, 3.75]), (False, [2.0, 3.0, 4.0])):
            held, times = backend.fetch(backend.score(generated, shaped=shaped))
            assert [r.reward for r in backend.rollouts(held)] == expected and "time/reward" in times
    finally:
        ray_local.kill(worker)


class Saver:
    """A trainer rank whose checkpoint lands where the driver sees it, or on a disk of its own node
    (``elsewhere``: nothing appears at the path here)."""

    def __init__(self, elsewhere: bool):
        self.elsewhere = elsewhere

    def save_checkpoint(self, path, state, extra):
        import os

        if not self.elsewhere:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "train_state.json"), "w") as f:
                f.write(state if isinstance(state, str) else "{}")
        return path


def test_a_checkpoint_the_driver_cannot_see_fails_the_save_by_name(ray_local, tmp_path):
    """On several nodes without a shared volume, trainer rank 0 writes the checkpoint on its own disk: the
    driver, which resumes (``--resume auto``), prunes and reads checkpoints, would find none later and
    start over in silence. The save fails at once, naming the path and what the output needs."""
    import pytest

    from cluster.ray_wing.weights import save_cluster_checkpoint
    from primitives.types import TrainState

    for elsewhere in (False, True):
        actor = ray_local.remote(num_cpus=0)(Saver).remote(elsewhere)
        cluster = RLCluster(generators=None, trainers=WorkerGroup("trainer", (actor,)), rewards=None, reference=None,
                            sync_address=None, weight_meta=(), pad_token_id=0, bucket_bytes=0, timeout_s=60,
                            ray_address="")
        path = str(tmp_path / f"step_{int(elsewhere)}")
        try:
            if elsewhere:
                with pytest.raises(FileNotFoundError, match="trainer rank 0 wrote it, but the driver .* does not see "
                                                            "it there.*a volume every node mounts"):
                    save_cluster_checkpoint(cluster, path, TrainState())
            else:
                assert save_cluster_checkpoint(cluster, path, TrainState()) == path
        finally:
            ray_local.kill(actor)
