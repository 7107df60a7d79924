"""What a snapshot of the stateful roles holds, and how a role is brought back to it: the records of
the recovery (``cluster.ray_wing.recovery``) and the calls that take and restore them.

A ``Snapshot`` holds, by reference, each trainer rank's and critic rank's part of its
DeepSpeed group's state (``rl_actors.deepspeed_rank.DeepSpeedRank.snapshot``: weights and
optimizer shards, step count, RNG; rank 0's part also the reference copy a trainer rank
holds) and a reference worker's weights. The parts are results of calls the driver made, so
the driver owns them: they stay in the object store when the actor that made them dies, and
they are copied to the driver's node (``cluster.ray_wing.custody``), so the loss of the node
that made them does not take them.

The ``log`` holds every update made since the snapshot (``Update``: the step's plan and its
rollouts and value shares, all by reference), so a group restored from the snapshot is
brought to the present by making the same updates again; with a snapshot after every step
the log holds at most the step in progress. Its chunks and value shares are kept on the
driver's node too.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional, Sequence

from cluster.ray_wing.groups import call, call_split, fan_out, gather


class Update(NamedTuple):
    """One train step as the trainer (and critic) ranks were asked to make it: enough to make it
    again on restored ranks and reach the same weights."""

    plan: object  # primitives.types.BatchPlan
    parts: tuple  # the rollout chunks' refs, each (scored rollouts, reference arrays or None)
    values: tuple  # the critic's value-share refs the step trained with (() without a critic)
    algo: object
    temperature: float
    lr: Optional[float]
    with_critic: bool  # the critic made its update in the step too
    moved: Optional[tuple] = None  # (step, kl) once the step's sync moved a tracking reference on the trainers


class SFTUpdate(NamedTuple):
    """One SFT step as the trainer ranks were asked to make it: the collated arrays (refs) and lr."""

    arrays: tuple  # refs of (input_ids, attention_mask, loss_mask)
    lr: Optional[float]


class Snapshot(NamedTuple):
    """The stateful roles' state at one point of the run, by reference (see the module docstring)."""

    trainers: tuple  # one part per trainer rank
    critics: tuple  # one part per critic rank (() without a critic)
    reference: Optional[object]  # a reference worker's state (every worker holds the same), None on the trainers
    nbytes: int  # the size of all parts
    seconds: float  # how long taking it took


def take_snapshot(cluster, reference_workers: bool, keep: Callable) -> Snapshot:
    """Every trainer and critic rank's part (collective within each group) and, with
    ``reference_workers``, reference worker 0's state; waited for until all are in the object
    store, only their sizes fetched, then kept on the driver's node (``keep``: a lost node
    must not take them)."""
    t0 = time.perf_counter()
    splits = [call_split(cluster.trainers, r, "snapshot") for r in range(cluster.trainers.size)]
    critic_splits = [call_split(cluster.critics, r, "snapshot") for r in range(cluster.critics.size)] \
        if cluster.critics is not None else []
    ref_split = [call_split(cluster.reference.group, 0, "snapshot")] if reference_workers else []
    every = splits + critic_splits + ref_split
    sizes = gather([s for s, _ in every], cluster.timeout_s)
    kept = keep([d for _, d in every], [s for s, _ in every])
    trainers, critics = kept[:len(splits)], kept[len(splits):len(splits) + len(critic_splits)]
    return Snapshot(tuple(trainers), tuple(critics), kept[-1] if ref_split else None, int(sum(sizes)),
                    time.perf_counter() - t0)


def restore_group(cluster, role: str, snapshot: Snapshot, log: Sequence[Update | SFTUpdate]) -> None:
    """Bring every rank of ``role`` (trainer or critic; live ranks or a rebuilt group) to the
    state after the snapshot and the updates of ``log``: the snapshot restored, then each
    update made again, in order, with the rollouts and value shares it had (an SFT step with its
    batch). A tracking reference on the trainer ranks moves again where the update's sync moved it."""
    group, parts = (cluster.trainers, snapshot.trainers) if role == "trainer" else (cluster.critics, snapshot.critics)
    gather(fan_out(group, "restore", *parts), cluster.timeout_s)
    for u in log:
        if isinstance(u, SFTUpdate):
            if role == "trainer":
                gather(fan_out(group, "sft_step", *u.arrays, u.lr), cluster.timeout_s)
            continue
        trailing = [x for part in u.parts for x in part] + list(u.values)
        if role == "trainer":
            gather(fan_out(group, "train_planned", u.plan, u.algo, u.temperature, u.lr, len(u.parts), *trailing),
                   cluster.timeout_s)
            if u.moved is not None and cluster.reference is not None and cluster.reference.where == "trainers":
                gather(fan_out(group, "move_reference", *u.moved), cluster.timeout_s)
        elif u.with_critic:
            gather(fan_out(group, "value_step_planned", u.plan, u.algo, len(u.parts), *trailing), cluster.timeout_s)


def restore_reference_workers(cluster, snapshot: Snapshot) -> None:
    """Every reference worker becomes the snapshot's reference (weights and update state)."""
    group = cluster.reference.group
    gather([call(group, r, "restore", snapshot.reference) for r in range(group.size)], cluster.timeout_s)


def snapshot_reference(cluster, keep: Callable) -> object:
    """Reference worker 0's state (every worker holds the same), by reference, once it is in
    the object store, kept on the driver's node (``keep``)."""
    size, data = call_split(cluster.reference.group, 0, "snapshot")
    gather([size], cluster.timeout_s)
    return keep([data], [size])[0]
