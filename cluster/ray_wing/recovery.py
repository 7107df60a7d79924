"""What survives an actor's death: in-memory snapshots of the stateful roles and the log of
updates since, and the operations that bring a rebuilt or a disturbed role back to the state
of the run.

The snapshot and the log of updates since (``cluster.ray_wing.snapshots``) hold the state; a
group restored from the snapshot is brought to the present by making the logged updates again.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from cluster.loop.protocol import RECOVERABLE_ROLES, ActorFailure
from cluster.ray_wing.custody import keep_here
from cluster.ray_wing.groups import actor_id, call, gather
from cluster.ray_wing.replace import rebuild_group, swap_actor
from cluster.ray_wing.roles import DEEPSPEED_ROLES, RLCluster, join_weight_sync
from cluster.ray_wing.snapshots import Snapshot, restore_group, restore_reference_workers, take_snapshot
from cluster.ray_wing.weights import sync_weights


def _key(role: str, rank: int) -> tuple:
    """What a recovery replaces for ``(role, rank)``: a DeepSpeed group is rebuilt whole."""
    return role, -1 if role in DEEPSPEED_ROLES else rank


def _single_actors_first(targets: Sequence[tuple], reference) -> list:
    """``(role, rank)`` targets of a recovery in the order to recover them: generator, reward and
    reference workers before trainer and critic groups (a reference on the trainer ranks is the
    trainers'). A rebuilt group rejoins the weight-sync group with every generator, so a stuck
    generator that waited in a broadcast beside trainer rank 0 must be replaced first, or the
    rebuild waits on it and fails again until the restarts are spent."""
    on_trainers = reference is not None and reference.where == "trainers"
    named = [("trainer" if role == "reference" and on_trainers else role, rank) for role, rank in targets]
    return sorted(named, key=lambda target: target[0] in DEEPSPEED_ROLES)


class Recovery:
    """The Ray backend's side that survives actors' deaths (``RayBackend`` is one): snapshots of
    the stateful roles, the log of updates since, and ``recover``, which replaces a dead or stuck
    actor and brings it to the run's state. It reads and sets the backend's ``cluster``,
    ``snapshot``, ``log``, ``faults``, ``restarts``, ``replaced_at``, ``version`` and
    ``last_move``, declared here and set by the backend's constructor."""

    cluster: RLCluster
    max_actor_restarts: int
    restarts: int  # actors replaced or groups rebuilt so far
    replaced_at: dict  # (role, rank) -> the restarts count its last replacement made
    version: int  # the policy version the generators hold (the last sync's)
    last_move: tuple  # (step, kl) of the last sync: a tracking reference's last move
    snapshot_every: Optional[int]  # steps between snapshots; None: by cost; 0: none
    snapshot_overhead: float
    snapshot_at: float  # time.perf_counter() of the last snapshot
    snapshot: Optional[Snapshot]
    log: list  # Updates since the snapshot
    faults: list  # one record per recovery
    snapshot_costs: list  # (seconds, bytes) of each snapshot
    kept: list  # [bytes, seconds] of results copied to the driver's node so far (``keep``)

    @property
    def restore_point(self) -> Snapshot:
        """The last snapshot, which every restore starts from (a run takes one before its first step)."""
        if self.snapshot is None:
            raise RuntimeError("no snapshot has been taken yet: nothing to restore the trainers from")
        return self.snapshot

    def recovering(self, op: Callable, after: Optional[Callable] = None, send_weights: bool = True):
        """``op()``, made again after each recovery from an actor's death or silence (``recover``;
        ``after(roles)`` runs before the next try, with the roles the recovery replaced, those of
        recoveries nested in it too), until it succeeds; a failure that is not recoverable, or more
        tries than ``max_actor_restarts`` allows, is raised."""
        for attempt in itertools.count():
            t0 = time.perf_counter()
            try:
                return op()
            except ActorFailure as failure:
                if attempt > self.max_actor_restarts:
                    raise
                first = len(self.faults)
                self.recover(failure, since=self.restarts, send_weights=send_weights, lost=time.perf_counter() - t0)
            if after is not None:
                after({f["role"] for f in self.faults[first:]})

    def _move_again(self, roles: set) -> None:
        """After a tracking reference worker died once the step's move was made (while its state
        was snapshotted): its replacement holds the state before the move, so every copy goes
        back there and the step's move is made once more (the sync sent again)."""
        if "reference" in roles and self._reference_workers_track():
            restore_reference_workers(self.cluster, self.restore_point)
            sync_weights(self.cluster, self.version, *self.last_move)

    def snapshot_due(self) -> bool:
        """Whether the step just synced ends with a snapshot: every ``snapshot_every`` updates;
        by cost (``snapshot_every`` None) once the time since the last one is at least its
        seconds over ``snapshot_overhead`` (at 5 %, a 0.1 s snapshot every 2 s of the run).
        (Tracking reference workers, which move every step, are snapshotted on their own after every
        step: ``sync``.)"""
        if self.snapshot_every == 0 or not self.log:
            return False
        if self.snapshot_every is not None:
            return len(self.log) >= self.snapshot_every
        cost = self.snapshot.seconds if self.snapshot is not None else 0.0
        return (time.perf_counter() - self.snapshot_at) * self.snapshot_overhead >= cost

    def prepare_recovery(self) -> None:
        """Snapshot the stateful roles as they are before the first step (after an SFT stage, a
        checkpoint load, the critic's creation), unless snapshots are off or one is current."""
        if self.snapshot_every != 0 and (self.snapshot is None or self.log):
            self.take_snapshot()

    def state_changed(self) -> None:
        """The stateful roles changed outside the update log (the SFT stage's reference copy and new
        optimizer, a critic added): the snapshot no longer restores them, and the next
        ``prepare_recovery`` takes a new one."""
        self.snapshot, self.log = None, []

    def take_snapshot(self) -> dict:
        """A new in-memory snapshot of the trainer and critic ranks (and the reference workers);
        the log of updates starts again. Returns ``faults/snapshot_s`` and ``faults/snapshot_mb``."""
        before = self.snapshot
        fresh_reference = self._reference_workers_track() or (before is None and self._has_reference_workers())
        if before is None:  # nothing to recover a group from yet
            self.snapshot = take_snapshot(self.cluster, fresh_reference, self.keep)
        else:  # the old snapshot and the log still hold the state: a rank that dies is recovered from them
            self.snapshot = self.recovering(lambda: take_snapshot(self.cluster, fresh_reference, self.keep),
                                            self._move_again)
        if not fresh_reference and before is not None:  # a fixed reference: its state once
            self.snapshot = self.snapshot._replace(reference=before.reference)
        self.log, self.snapshot_at = [], time.perf_counter()
        self.snapshot_costs.append((self.snapshot.seconds, self.snapshot.nbytes))
        return {"faults/snapshot_s": self.snapshot.seconds, "faults/snapshot_mb": self.snapshot.nbytes / 2 ** 20}

    def _has_reference_workers(self) -> bool:
        return self.cluster.reference is not None and self.cluster.reference.where == "workers"

    def _reference_workers_track(self) -> bool:
        """Reference workers that move every step: their state is snapshotted after every sync."""
        return self._has_reference_workers() and self.cluster.reference_handle.tracks

    def _restore_tracking_reference(self) -> None:
        """After a failed sync: a tracking reference may have moved on some ranks; every copy goes
        back to before the step's move (workers: the snapshot, taken after every move; on the
        trainers: the trainer ranks' snapshot and log, without the step's move)."""
        ref = self.cluster.reference
        if ref is None or not ref.tracks or self.snapshot is None:
            return
        if ref.where == "workers":
            restore_reference_workers(self.cluster, self.restore_point)
        else:
            restore_group(self.cluster, "trainer", self.snapshot, self.log)

    def keep(self, refs: Sequence, made_by: Sequence) -> list:
        """``refs`` with each object that lives only on another node copied to the driver's
        (``custody.keep_here``: snapshot parts, rollout chunks, value shares must outlive a lost
        node); the copies' bytes and seconds go to ``kept``."""
        t0 = time.perf_counter()
        out, copied = keep_here(refs, made_by, self.cluster.timeout_s)
        if copied:
            self.kept[0] += copied
            self.kept[1] += time.perf_counter() - t0
        return out

    def fault_metrics(self) -> dict:
        """``faults/restarts/<role>`` (actors replaced or groups rebuilt so far),
        ``faults/seconds_lost`` (failed attempts and recoveries, so far) and, once results were
        copied to the driver's node (several nodes), ``faults/kept_mb`` and ``faults/kept_s`` so far."""
        out = {"faults/seconds_lost": sum(f["seconds"] + f["lost"] for f in self.faults)}
        if self.kept[0]:
            out.update({"faults/kept_mb": self.kept[0] / 2 ** 20, "faults/kept_s": self.kept[1]})
        for f in self.faults:
            key = f"faults/restarts/{f['role']}"
            out[key] = out.get(key, 0.0) + 1.0
        return out

    def recover(self, failure: ActorFailure, since: int, send_weights: bool = True,
                lost: float = 0.0) -> Optional[str]:
        """Replace the dead or stuck actor of ``failure`` (a stuck one is killed first), unless it
        was replaced after ``since`` (a ``restarts`` count) already; the caller then does the
        lost work again. ``lost``: seconds of work the failure threw away (logged).

        * A generator receives the current weights, labelled with the last sync's version
          (unless ``send_weights`` is false: the next sync brings them); a reward worker
          needs nothing.
        * A reference worker becomes the snapshot's reference (the reference's current
          weights: fixed, or where its last move left it).
        * A trainer or critic rank: its whole group is rebuilt (``replace.rebuild_group``); then
          both groups are restored to the snapshot and the updates of the log made again, so
          they hold the state after the last finished update; a rebuilt trainer group's hosted
          generators get the version.
        * The weight-sync group is formed again with the new actors already in the cluster: a
          member that fails as it forms (dead too) is recovered in turn with them as its peers
          (they were killed before, so two dead generators replaced each other in turn until
          the restarts ran out); then this recovery goes on from the step it was cut in, on its
          new actors (two dead generators: two restarts).
        * Actors that did not answer in time together (a collective: the stuck one and the
          peers waiting for it; which is which cannot be told from outside) are all replaced.

        Returns the last role recovered (a reference on the trainer ranks is the trainers'),
        None when nothing was to do. Re-raises a failure that is not of a dead or stuck actor
        (a user function that raised), or that exceeds ``max_actor_restarts``, or of a
        trainer, critic or reference when no snapshot is kept."""
        targets = self._targets(failure)
        if targets is None:
            return None  # one replaced already: only the work is redone
        targets, last = tuple(_single_actors_first(targets, self.cluster.reference)), None
        progress: dict = {}  # _key -> (the steps done for it, its record in faults), kept across the tries
        for cuts in itertools.count():
            try:
                return self._recover_targets(failure, targets, since, send_weights, lost, progress) or last
            except ActorFailure as nested:  # another actor died or hung while this one was being recovered
                if nested is failure or not nested.replaceable:
                    raise
                if cuts >= self.max_actor_restarts:  # a try after a cut costs no restart: bounded here
                    raise ActorFailure(f"{failure} (its recovery was cut {cuts + 1} times, the last time by: "
                                       f"{nested}; cluster.max_restarts)", failure.role, failure.rank, failure.died,
                                       failure.stuck, final=True) from nested
                tqdm.write(f"{nested}\n(while recovering from: {failure})")
                before = dict(self.replaced_at)
                last = self.recover(nested, since=self.restarts, send_weights=send_weights) or last
                # then this recovery again for the same targets, but those the nested recovery replaced whole; each
                # goes on from the step it was cut in (its new actors are the cluster's already: not made again)
                targets = tuple(t for t in targets if self.replaced_at.get(_key(*t)) == before.get(_key(*t)))
                since, lost = self.restarts, 0.0
        raise AssertionError("unreachable")  # the loop returns or raises

    def _targets(self, failure: ActorFailure) -> Optional[tuple]:
        """``(role, rank)`` of the actors ``failure`` names; None when it is of one replaced already."""
        if not failure.replaceable:
            raise failure
        if failure.actor_id:  # the actor that died (the call may have read its result)
            where = self.locate(failure.actor_id)
            return None if where is None else (where,)
        return failure.late if failure.stuck and not failure.died else ((failure.role, failure.rank),)

    def _recover_targets(self, failure: ActorFailure, targets: tuple, since: int, send_weights: bool,
                         lost: float, progress: dict) -> Optional[str]:
        done = None
        for role, rank in targets:
            if role in RECOVERABLE_ROLES:
                done = self._recover_one(failure, role, rank, since, send_weights, lost, progress) or done
        return done

    def _recover_one(self, failure: ActorFailure, role: str, rank: int, since: int, send_weights: bool,
                     lost: float, progress: dict) -> Optional[str]:
        """One target's recovery, in steps (``_recovery_steps``). ``progress`` holds, for a target whose
        earlier try in the same ``recover`` was cut by another actor's failure, the steps that try finished:
        this try goes on from there, on the new actors the cluster already holds, and completes the
        cut try's record (``cut``: what cut it) instead of counting another restart."""
        key = _key(role, rank)
        steps_done, record = progress.get(key, (set(), None))
        if "done" in steps_done:
            return role  # finished before a later target's recovery was cut
        if "place" not in steps_done:  # no new actor in place yet: a try of its own, counted, recorded anew
            steps_done, record = set(), None
            if role == "generator" and rank >= self.cluster.generator_handle.size:
                return None  # a worker that left when the generators shrank: only its work is redone, on those left
            if self.replaced_at.get(key, -1) > since:
                return None  # already replaced since the work was dispatched: only the work is redone
            self._check_recoverable(failure, role, rank)
            self.restarts += 1
            self.replaced_at[key] = self.restarts
            stuck = failure.stuck and not failure.died
            tqdm.write(f"{failure}\n{role} {rank} {'stopped answering: killing it' if stuck else 'died'}; "
                       f"{'rebuilding the ' + role + ' group' if role in DEEPSPEED_ROLES else 'replacing it'} "
                       "and doing its work again")
            record = {"role": role, "rank": rank, "stuck": stuck, "lost": lost, "version": self.version,
                      "seconds": 0.0, "replayed": 0}
            self.faults.append(record)
            progress[key] = (steps_done, record)
        t0 = time.perf_counter() - record["seconds"]  # a cut try's seconds count on
        try:
            for name, step in self._recovery_steps(role, rank, send_weights):
                if name not in steps_done:
                    step()
                    steps_done.add(name)
        except BaseException as error:  # a recovery that failed counts too: the summary shows what it cost
            record.update(seconds=time.perf_counter() - t0, failed=f"{type(error).__name__}: {error}"[:300])
            raise
        if "failed" in record:  # cut by another failure, and finished now
            record["cut"] = record.pop("failed")
        record.update(seconds=time.perf_counter() - t0, replayed=len(self.log))
        steps_done.add("done")
        tqdm.write(f"{role} {rank}: recovered in {record['seconds']:.1f} s")
        return role

    def _check_recoverable(self, failure: ActorFailure, role: str, rank: int) -> None:
        if self.restarts >= self.max_actor_restarts:
            raise ActorFailure(f"{failure} (after {self.restarts} recoveries, cluster.max_restarts)", failure.role,
                               rank, failure.died, failure.stuck, final=True) from failure
        if (role in DEEPSPEED_ROLES or role == "reference") and self.snapshot is None:
            raise ActorFailure(f"{failure} (no snapshot yet to restore a {role} from: one is taken when training "
                               "starts, none with cluster.snapshot_every 0)",
                               failure.role, rank, failure.died, failure.stuck, final=True) from failure

    def _recovery_steps(self, role: str, rank: int, send_weights: bool) -> list:
        """``(name, step)`` in order for one target. The new actors are the cluster's before the weight-sync
        group forms again: a join that fails on another member (dead too) leaves them in place, and that
        member's recovery forms the group with them. A later recovery does not undo a finished step: a critic's
        rebuild restores both groups, and any sync member's recovery forms the group with every member."""
        def put(cluster):
            self.cluster = cluster

        if role in DEEPSPEED_ROLES:
            steps = [("place", lambda: put(rebuild_group(self.cluster, role))), ("restore", self._restore_groups)]
            return steps + ([("join", lambda: put(join_weight_sync(self.cluster)))] if role == "trainer" else [])
        steps = [("place", lambda: put(swap_actor(self.cluster, role, rank)))]
        if role == "generator" or (role == "reference" and self.cluster.reference_workers.tracks):
            steps.append(("join", lambda: put(join_weight_sync(self.cluster))))  # a fixed reference is not in it
        if role == "reference":
            steps.append(("restore", lambda: gather([call(self.cluster.reference_workers.group, rank, "restore",
                                                          self.restore_point.reference)], self.cluster.timeout_s)))
        if role == "generator" and send_weights:
            steps.append(("sync", lambda: sync_weights(self.cluster, self.version, move_reference=False)))
        return steps

    def locate(self, dead_id: str) -> Optional[tuple]:
        """``(role, rank)`` of the actor with id ``dead_id`` in the cluster as it is now; None
        when no current actor has it (it was replaced already)."""
        c = self.cluster
        groups = [getattr(c.generators, "group", None), c.rewards, getattr(c.reference, "group", None), c.trainers,
                  c.critics]
        for group in groups:
            if group is None:
                continue
            for rank, actor in enumerate(group.actors):
                if actor_id(actor) == dead_id:
                    return group.role, rank
        return None

    def fault_summary(self) -> dict:
        """What the run survived, for its summary: each recovery (role, rank, stuck or dead, the
        policy version it happened at, seconds to recover, updates made again; ``failed``, the
        error, for an attempt that did not succeed; ``cut``, the failure that cut an attempt
        finished after it), restarts (attempts) and failed attempts by
        role, the median seconds of a successful recovery by role, seconds lost, and the
        snapshots' median cost."""
        by_role: dict = {}
        for f in self.faults:
            by_role.setdefault(f["role"], []).append(f)
        costs = self.snapshot_costs
        return {"recoveries": [{k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()}
                               for f in self.faults],
                "restarts": {role: len(fs) for role, fs in by_role.items()},
                "failed_recoveries": {role: n for role, fs in by_role.items() if (n := sum("failed" in f for f in fs))},
                "recovery_s_median": {role: round(float(np.median(ok)), 3) for role, fs in by_role.items()
                                      if (ok := [f["seconds"] for f in fs if "failed" not in f])},
                "seconds_lost": round(sum(f["seconds"] + f["lost"] for f in self.faults), 3),
                "snapshot_every": self.snapshot_every if self.snapshot_every is not None else "by cost",
                "snapshots": len(costs),
                "snapshot_s_median": round(float(np.median([t for t, _ in costs])), 4) if costs else None,
                "snapshot_mb": round(costs[-1][1] / 2 ** 20, 2) if costs else None}

    def _restore_groups(self) -> None:
        """Both DeepSpeed groups (trainer, critic) to the state after the last finished update:
        the snapshot, then the log's updates made again."""
        restore_group(self.cluster, "trainer", self.restore_point, self.log)
        if self.cluster.critics is not None:
            restore_group(self.cluster, "critic", self.restore_point, self.log)
        gens = self.cluster.generators  # None in an SFT job's cluster
        if gens is not None and gens.where == "trainers":  # generators hosted by rebuilt ranks: their version
            gather(gens.receive_weights((), 0, self.version), self.cluster.timeout_s)

    def settle(self, collections: Sequence) -> None:
        """Wait for the generation of the collections in flight (``cluster.loop.train.Collection``;
        a weight sync waits for it anyway) and replace a generator that died under one, so that
        the sync reaches a live group; the lost rollouts are generated again when their step
        fetches them. The generation is waited for where it runs (nothing is fetched), then
        every generator is pinged: a dead one is replaced."""
        import ray

        for coll in collections:  # waited for where they are: nothing is fetched to the driver
            refs = [c.ref for c in coll.handle.phases[0][1]]
            ray.wait(refs, num_returns=len(refs), timeout=self.cluster.timeout_s, fetch_local=False)
        for ping in self.cluster.generator_handle.ping():
            try:
                gather([ping], self.cluster.timeout_s)
            except ActorFailure as failure:
                if failure.died:
                    self.recover(failure, since=self.restarts, send_weights=False)
