"""Replacing the actors of a running cluster: one generator, reward or reference worker
(``swap_actor``), or a whole DeepSpeed group (``rebuild_group``). Neither forms the weight-sync
group again: the recovery does that next (``roles.join_weight_sync``), with the new actors already
the cluster's, so that a join that fails on another member leaves them in place for the next try."""
from __future__ import annotations

from cluster.ray_wing.groups import Call, call, fan_out, gather, kill_actor
from cluster.ray_wing.handles import GeneratorsOnTrainers, ReferenceOnTrainers
from cluster.ray_wing.roles import DEEPSPEED_ROLES, RLCluster


def swap_actor(cluster: RLCluster, role: str, rank: int) -> RLCluster:
    """The cluster with a new generator, reward or reference worker in the old one's bundle (the
    old one killed, if it still runs: a stuck actor), loaded; nothing else. The caller forms the
    weight-sync group again for a generator or a tracking reference (``join_weight_sync``), then
    sends the current weights, or restores the reference's state."""
    if not cluster.factories or role not in cluster.factories or role in DEEPSPEED_ROLES:
        raise ValueError(f"no way to replace a {role}: only generator, reward and reference workers are replaced "
                         "one by one (a trainer or critic group is rebuilt whole: rebuild_group)")
    if role == "reward":
        group = cluster.reward_group
    else:
        group = cluster.reference_workers.group if role == "reference" else cluster.generator_workers.group
    kill_actor(group.actors[rank])
    actor = cluster.factories[role].create(rank, *group.slot(rank))
    try:
        gather([Call(actor.info.remote(), role, rank, "info")], cluster.start_s)
    except BaseException:  # a replacement the cluster does not get must not hold the bundle for the next try
        kill_actor(actor)
        raise
    actors = list(group.actors)
    actors[rank] = actor
    group = group._replace(actors=tuple(actors))
    if role == "reward":
        return cluster._replace(rewards=group)
    if role == "reference":
        return cluster._replace(reference=cluster.reference_workers._replace(group=group))
    return cluster._replace(generators=cluster.generator_workers._replace(group=group))


def rebuild_group(cluster: RLCluster, role: str) -> RLCluster:
    """The cluster with every rank of the ``role`` group (trainer or critic) anew, in the same
    bundles: the old ranks are killed (one rank's death leaves its peers' process group broken,
    some of them waiting in a collective), the new ones rendezvous and build their engines from
    the model as the group first did. The roles hosted on the trainer ranks (generation, the
    reference copy) move with them. The caller restores their state (``snapshots.restore_group``)
    and forms the weight-sync group again around the new trainer rank 0 (``join_weight_sync``)."""
    group = cluster.trainers if role == "trainer" else cluster.critics
    if role not in DEEPSPEED_ROLES or group is None or not cluster.factories or role not in cluster.factories:
        raise ValueError(f"no {role} group to rebuild")
    for actor in group.actors:
        kill_actor(actor)
    factory = cluster.factories[role]
    group = group._replace(actors=tuple(factory.create(r, *group.slot(r)) for r in range(group.size)))
    try:
        master = gather([call(group, 0, "endpoint")], cluster.start_s)[0]
        gather(fan_out(group, "setup", *master), cluster.start_s)
    except BaseException:  # ranks the cluster does not get must not hold the bundles for the next try
        for actor in group.actors:
            kill_actor(actor)
        raise
    if role == "critic":
        return cluster._replace(critics=group)
    generators, reference = cluster.generators, cluster.reference
    if isinstance(generators, GeneratorsOnTrainers):
        generators = GeneratorsOnTrainers(group)
    if isinstance(reference, ReferenceOnTrainers):
        reference = reference._replace(trainers=group)
    return cluster._replace(trainers=group, generators=generators, reference=reference)
