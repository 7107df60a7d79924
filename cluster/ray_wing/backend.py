"""The Ray backend of the loops (``cluster.loop.protocol``): the operations on the actors of an
``RLCluster``.

Rollouts move between actors as ObjectRefs and never through the driver: ``generate``,
``reference_logprobs`` and ``score`` chain calls without waiting; ``fetch`` waits for them,
phase by phase, timing each, and fetches only the reward workers' summaries; the trainer
(and critic) ranks receive the chunks by reference and build the step's batch themselves. A
dead, stuck or failing actor surfaces as an ``ActorFailure`` that names its role and rank;
``recover`` replaces a dead or stuck actor of any role and the loop does the lost work again:
a generator, reward or reference worker is replaced (a reference restored to the
reference's current weights); a trainer or critic group is rebuilt whole and restored from
the in-memory snapshot and the log of updates since (``cluster.ray_wing.recovery``), so the
run goes on with the weights an undisturbed run has.
"""
from __future__ import annotations

import itertools
import os
import shutil
import time
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
from tqdm import tqdm

from cluster.loop.protocol import RECOVERABLE_ROLES, ActorFailure, Held, StepResult, plan_parts
from cluster.ray_wing.groups import (
    actor_id,
    call,
    call_split,
    fan_out,
    first_death,
    gather,
    settle,
    split_evenly,
    wait_next,
)
from cluster.ray_wing.recovery import (
    Snapshot,
    Update,
    restore_group,
    restore_reference_workers,
    snapshot_reference,
    take_snapshot,
)
from cluster.ray_wing.roles import DEEPSPEED_ROLES, RLCluster, rebuild_group, replace_actor
from primitives.io.checkpoint import state_from_json, state_to_json
from primitives.types import BatchPlan, GenerationConfig, TrainState, planned_rollouts


def _flat(lists) -> list:
    return [x for chunk in lists for x in chunk]


def sync_weights(cluster: RLCluster, version: int, step: int = 0, kl: Optional[float] = None,
                 move_reference: bool = True) -> dict:
    """Broadcast the trainers' weights to every generator (and every tracking reference worker).
    A tracking reference applies its ``ref_update_fn`` once per RL step: a sync that only
    refreshes the generators (a checkpoint load, a replaced generator, the SFT stage's end)
    passes ``move_reference=False``, and a reference worker takes part in the broadcast
    unmoved. A reference on the trainer ranks moves there, after the broadcast. Generators on the
    trainer ranks already hold the weights: they take the version only, and with no one else to
    send to (sync group of 1) nothing is broadcast."""
    t0 = time.perf_counter()
    meta, bucket = list(cluster.weight_meta), cluster.bucket_bytes
    calls = fan_out(cluster.trainers, "send_weights", meta, bucket) if cluster.sync_address.world_size > 1 else []
    calls += cluster.generators.receive_weights(meta, bucket, version)
    if cluster.reference is not None:
        calls += cluster.reference.sync(meta, bucket, step, kl, move_reference)
    moved = gather(calls, cluster.timeout_s)[0]
    dt = time.perf_counter() - t0
    return {"time/sync": dt, "sync/bytes": float(moved), "sync/version": float(version)}


def copy_policy_to_reference(cluster: RLCluster) -> None:
    """Make every reference rank equal to the current policy (after SFT, say). Trainer rank 0's
    weights go to the reference ranks by ref (one object, never through the driver); the other
    trainer ranks join ZeRO-3 gathers. A reference on the trainers copies each rank's policy."""
    if cluster.reference is not None:
        gather(cluster.reference.copy_policy(cluster.trainers), cluster.timeout_s)


def save_cluster_checkpoint(cluster: RLCluster, path: str, state: TrainState) -> str:
    """Trainer shards with optimizer and RNG, an HF copy, the reference weights and the
    ``TrainState`` (data position, versions, metrics), written atomically to ``path``."""
    extra = {}
    if cluster.critics is not None:  # the critic's shards and HF copy, moved in by trainer rank 0
        critic_tmp = path.rstrip("/") + ".critic.tmp"
        shutil.rmtree(critic_tmp, ignore_errors=True)
        gather(fan_out(cluster.critics, "save_checkpoint", critic_tmp), cluster.timeout_s)
        extra["critic"] = critic_tmp
    if cluster.reference is not None:  # every copy is the same: one saves it
        ref_tmp = path.rstrip("/") + ".reference.tmp"
        shutil.rmtree(ref_tmp, ignore_errors=True)
        gather([cluster.reference.save(ref_tmp)], cluster.timeout_s)
        extra["reference"] = ref_tmp
    gather(fan_out(cluster.trainers, "save_checkpoint", path, state_to_json(state), extra), cluster.timeout_s)
    return path


def load_cluster_checkpoint(cluster: RLCluster, path: str) -> TrainState:
    """Restore what ``save_cluster_checkpoint`` wrote and send the weights to the generators;
    training continues exactly where it stopped."""
    saved = gather(fan_out(cluster.trainers, "load_checkpoint", path), cluster.timeout_s)[0]
    state = state_from_json(saved)
    saved_reference = os.path.join(path, "reference")
    if cluster.reference is not None and os.path.isdir(saved_reference):
        gather(cluster.reference.load(saved_reference), cluster.timeout_s)
    if cluster.critics is not None:
        if not os.path.isdir(os.path.join(path, "critic")):
            raise FileNotFoundError(f"{path} holds no critic/ to resume the critic from")
        gather(fan_out(cluster.critics, "load_checkpoint", os.path.join(path, "critic")), cluster.timeout_s)
    if cluster.generators is not None:  # an SFT job has no generators
        sync_weights(cluster, state.policy_version, move_reference=False)
    return state


class RolloutRefs(NamedTuple):
    """Rollouts in flight: the calls of each phase so far, in order (the last holds them), and
    optionally two branches that both read the last phase's rollouts and run side by side:
    ``("ref", calls)`` giving reference-logprob arrays and ``("reward", calls)`` giving the
    rollouts' summaries. Once scored, ``parts`` holds each chunk's data by reference:
    ``(scored rollouts ref, reference-logprob arrays ref or None)``."""

    phases: tuple  # ((phase name, [Call, ...]), ...)
    branches: tuple = ()  # ((("ref", [Call, ...]), ("reward", [Call, ...])) or ()
    parts: tuple = ()

    def then(self, name: str, calls: list, parts: tuple = ()) -> "RolloutRefs":
        return RolloutRefs(self.phases + ((name, calls),), parts=parts)


def flat_parts(parts: Sequence) -> list:
    """The parts as a planned call's trailing arguments (``rl_actors.common.planned_inputs``):
    Ray hands each top-level ref to the actor as its value."""
    return [x for part in parts for x in part]


def wait_each(phases: Sequence[tuple], timeout_s: float) -> dict:
    """Seconds until each ``(name, calls)`` phase has all its results, phases waited for
    together (no error checks but heartbeats: ``gather`` names failures afterwards)."""
    t0, left, done = time.perf_counter(), {name: {c.ref for c in calls} for name, calls in phases}, {}
    by_ref = {c.ref: c for _, calls in phases for c in calls}
    pending = list(by_ref)
    while pending:
        # an actor whose heartbeat stopped fails the wait at once, named (wait_next); a slow one is named by gather
        ready, pending = wait_next(pending, by_ref, time.monotonic() + timeout_s)
        if not ready:
            break
        for name, refs in left.items():
            refs.difference_update(ready)
            if not refs and name not in done:
                done[name] = time.perf_counter() - t0
    return {name: done.get(name, time.perf_counter() - t0) for name, _ in phases}


def _single_actors_first(targets: Sequence[tuple], reference) -> list:
    """``(role, rank)`` targets of a recovery in the order to recover them: generator, reward and
    reference workers before trainer and critic groups (a reference on the trainer ranks is the
    trainers'). A rebuilt group rejoins the weight-sync group with every generator, so a stuck
    generator that waited in a broadcast beside trainer rank 0 must be replaced first, or the
    rebuild waits on it and fails again until the restarts are spent."""
    on_trainers = reference is not None and reference.where == "trainers"
    named = [("trainer" if role == "reference" and on_trainers else role, rank) for role, rank in targets]
    return sorted(named, key=lambda target: target[0] in DEEPSPEED_ROLES)


class RayBackend:
    """The RL loop's operations on a Ray cluster (see ``cluster.loop.train.train``).

    ``cluster`` is replaced when an actor is (``recover``); read it from here afterwards."""

    name = "ray"
    remote = True  # functions travel to the actors: they must pickle

    def __init__(self, cluster: RLCluster, max_actor_restarts: int = 3, snapshot_every: Optional[int] = None,
                 snapshot_overhead: float = 0.05):
        self.cluster, self.max_actor_restarts, self.restarts = cluster, max_actor_restarts, 0
        self.replaced_at: dict = {}  # (role, rank) -> the restarts count its last replacement made
        self.version = 0  # the policy version the generators hold (the last sync's)
        # steps between in-memory snapshots; None: by cost (at most snapshot_overhead of the time); 0: none (a trainer
        # death ends the run)
        self.snapshot_every, self.snapshot_overhead = snapshot_every, snapshot_overhead
        self.snapshot_at = 0.0  # time.perf_counter() when the last snapshot was taken
        self.last_move: tuple = (0, None)  # (step, kl) of the last sync: a tracking reference's last move
        self.snapshot: Optional[Snapshot] = None
        self.log: list = []  # Updates since the snapshot
        self.faults: list = []  # one record per recovery: role, rank, what happened, seconds
        self.snapshot_costs: list = []  # (seconds, bytes) of each snapshot taken
    @property
    def pad_token_id(self) -> int:
        return self.cluster.pad_token_id

    @property
    def has_reference(self) -> bool:
        return self.cluster.reference is not None

    @property
    def reference_in_train_step(self) -> bool:
        """The trainer ranks hold the reference: they score their own shards in the train step
        (and the rollouts, when KL goes in the reward)."""
        return self.cluster.reference is not None and self.cluster.reference.in_train_step

    @property
    def reward_needs_reference(self) -> bool:
        return self.cluster.reward_needs_reference

    @property
    def has_critic(self) -> bool:
        return self.cluster.critics is not None

    # ------------------------------------------------------------------ rollouts
    def generate(self, items: Sequence, gen: GenerationConfig, tools=None) -> RolloutRefs:
        """``gen.n`` rollouts per item, the items split evenly over the generators
        (tool-using rollouts when ``tools`` is a ``ToolConfig``)."""
        generators = self.cluster.generators
        chunks = split_evenly(list(items), generators.size)
        return RolloutRefs((("generate", [generators.generate(r, chunk, gen, tools)
                                          for r, chunk in enumerate(chunks) if chunk]),))

    def reference_logprobs(self, refs: RolloutRefs, temperature: float) -> RolloutRefs:
        """Reference logprobs of the rollouts, at the sampling temperature."""
        chunks = [x.ref for x in refs.phases[-1][1]]
        return refs.then("ref", [self.cluster.reference.with_ref_logprobs(i, x, temperature)
                                 for i, x in enumerate(chunks)])

    def _score(self, chunks: Sequence) -> tuple:
        """``(summary calls, scored-rollout refs)`` of each chunk, spread over the reward workers."""
        c = self.cluster
        split = [call_split(c.rewards, i % c.rewards.size, "score_summarized", x) for i, x in enumerate(chunks)]
        return [s for s, _ in split], [d for _, d in split]

    def score(self, refs: RolloutRefs) -> RolloutRefs:
        """Rewards of the rollouts, the chunks spread over the reward workers."""
        calls, data = self._score([x.ref for x in refs.phases[-1][1]])
        return refs.then("reward", calls, tuple((d, None) for d in data))

    def score_and_reference(self, refs: RolloutRefs, temperature: float) -> RolloutRefs:
        """Rewards and reference logprobs of the rollouts side by side (neither reads the
        other): the chunks go to the reward workers and the reference workers at once, the
        reference returning only its logprob arrays."""
        chunks = [x.ref for x in refs.phases[-1][1]]
        ref = [self.cluster.reference.logprobs(i, x, temperature) for i, x in enumerate(chunks)]
        reward, data = self._score(chunks)
        return RolloutRefs(refs.phases, (("ref", [count for count, _ in ref]), ("reward", reward)),
                           tuple((d, arrays) for d, (_, arrays) in zip(data, ref)))

    def fetch(self, refs: RolloutRefs) -> tuple:
        """``(Held rollouts, {"time/<phase>": seconds})``: waits for every phase (each timed from
        the end of the one before it; side-by-side branches from the end of the last phase) and
        fetches only the summaries. A failure is named by the first phase that failed, so a
        dead generator is not reported as the reward worker that waited for it."""
        phases = list(refs.phases) + list(refs.branches)
        done = wait_each(phases, self.cluster.timeout_s)
        times, before = {}, 0.0
        for name, _ in refs.phases:
            times[f"time/{name}"], before = done[name] - before, done[name]
        times.update({f"time/{name}": done[name] - before for name, _ in refs.branches})
        summary_calls = (refs.branches[-1] if refs.branches else refs.phases[-1])[1]
        try:  # every phase had its time in wait_each: what is not done now is stuck
            waited = self.cluster.timeout_s
            chunks = gather(summary_calls, 0, waited)
            for _, calls in refs.branches[:-1]:  # the reference's counts: a failure there, not in the train step
                settle(calls, 0, waited)
        except ActorFailure:
            for _, calls in phases:  # the earliest failure names its actor (the chunks stay where they are)
                settle(calls, 0, waited)
            raise
        with_ref = bool(refs.branches)  # the reference's arrays join the rollouts where they are trained
        return [Held(s._replace(has_ref=True) if with_ref else s, part, i)
                for part, summaries in zip(refs.parts, chunks, strict=True) for i, s in enumerate(summaries)], times

    def select(self, rows: Sequence, filters: Sequence) -> list:
        """The rows ``filters`` keep, in their order: the filters run on a reward worker, which
        receives the rows' chunks by reference, and only positions come back."""
        positions, parts = plan_parts(rows)
        kept = gather([call(self.cluster.rewards, 0, "select", tuple(filters), positions, len(parts),
                            *flat_parts(parts))], self.cluster.timeout_s)[0]
        return [rows[k] for k in kept]

    def rollouts(self, rows: Sequence) -> list:
        """The full rollouts of ``rows``, fetched to the driver (evaluation writes them out)."""
        import ray

        positions, parts = plan_parts(rows)
        pulled = [tuple(None if x is None else ray.get(x, timeout=self.cluster.timeout_s) for x in part)
                  for part in parts]
        return planned_rollouts(BatchPlan(positions, 0), pulled)

    def values(self, plan: BatchPlan, parts: list) -> list:
        """The critic ranks' value shares of the plan's rollouts, as calls in flight (their refs
        go on to the train step; nothing is fetched here)."""
        c = self.cluster
        if not self.has_critic:
            raise ValueError("this cluster has no critic; build it with a critic for an algorithm whose "
                             "advantage function reads values (PPO's GAE)")
        return fan_out(c.critics, "values_planned", plan, len(parts), *flat_parts(parts))

    # ------------------------------------------------------------------ training
    def train_step(self, plan: BatchPlan, parts: list, values: Optional[list], algo, temperature: float,
                   lr: Optional[float], with_critic: bool = False) -> StepResult:
        """The planned batch on every trainer rank (and the critic ranks when ``with_critic``),
        concurrently; each rank builds the batch from the parts and value shares it receives by
        reference. If a rank of either group dies or stops answering, its group is rebuilt,
        both groups are restored to the state before the step (``recover``), the value shares
        are computed again and the step is made again with the same rollouts."""
        parts, inputs = [tuple(p) for p in parts], {"values": values}

        def again(role: Optional[str]) -> None:  # the value shares of a dead critic are lost: computed again
            if values is not None:
                inputs["values"] = self.values(plan, parts)

        result = self.recovering(lambda: self._train_call(plan, parts, inputs["values"], algo, temperature, lr,
                                                          with_critic), again)
        if result.batch_metrics is not None and self.snapshot_every != 0:  # without snapshots nothing replays it
            self.log.append(Update(plan, tuple(parts), tuple(v.ref for v in inputs["values"] or ()), algo, temperature,
                                   lr, with_critic))
        return result

    def recovering(self, op: Callable, after: Optional[Callable] = None, send_weights: bool = True):
        """``op()``, made again after each recovery from an actor's death or silence (``recover``;
        ``after(recovered role)`` runs before the next try), until it succeeds; a failure that is
        not recoverable, or more tries than ``max_actor_restarts`` allows, is raised."""
        for attempt in itertools.count():
            t0 = time.perf_counter()
            try:
                return op()
            except ActorFailure as failure:
                if attempt > self.max_actor_restarts:
                    raise
                role = self.recover(failure, since=self.restarts, send_weights=send_weights,
                                    lost=time.perf_counter() - t0)
            if after is not None:
                after(role)

    def _train_call(self, plan: BatchPlan, parts: list, values: Optional[list], algo, temperature: float,
                    lr: Optional[float], with_critic: bool) -> StepResult:
        c = self.cluster
        trailing = [*flat_parts(parts), *[v.ref for v in values or ()]]
        calls = fan_out(c.trainers, "train_planned", plan, algo, temperature, lr, len(parts), *trailing)
        critic_calls = fan_out(c.critics, "value_step_planned", plan, algo, len(parts), *trailing) \
            if with_critic else []  # at the critic's lr
        try:
            results = gather(calls + list(values or ()) + critic_calls, c.timeout_s)
        except ActorFailure as failure:
            dead = first_death(list(values or ()))  # a critic that died computing values, not its readers, failed
            if dead is not None:
                raise dead from failure
            raise
        policy = results[: len(calls)]
        return StepResult([updates for updates, _ in policy], results[len(results) - len(critic_calls):]
                          if with_critic else None, policy[0][1])

    def sft_step(self, arrays: tuple, lr: Optional[float]) -> list:
        """One SFT step on every trainer rank (each takes its rows of the collated arrays)."""
        import ray

        c = self.cluster
        return gather(fan_out(c.trainers, "sft_step", *[ray.put(a) for a in arrays], lr), c.timeout_s)

    def sft_eval(self, arrays: tuple) -> list:
        import ray

        c = self.cluster
        return gather(fan_out(c.trainers, "sft_eval", *[ray.put(a) for a in arrays]), c.timeout_s)

    def sync(self, version: int, step: int, kl: Optional[float]) -> dict:
        """The step's weights to the generators (and a tracking reference), then, every
        ``snapshot_every`` steps, a new in-memory snapshot. If an actor dies or stops answering
        during the sync it is replaced (a trainer group rebuilt and brought to the state after
        the step; a tracking reference restored to before its move) and the sync made again."""
        def again(role: Optional[str]) -> None:
            # a tracking reference may have moved before the failure: back to before the move (a reference on
            # rebuilt trainer ranks was restored to the step's end, before its move, already)
            ref = self.cluster.reference
            if ref is not None and ref.tracks and self.snapshot is None:
                raise ActorFailure("a weight sync failed after the tracking reference may have moved, and no "
                                   "snapshot (cluster.snapshot_every 0) can undo the move: the run stops rather "
                                   "than move it twice", "reference", 0, final=True)
            if ref is not None and (ref.where == "workers" or role not in DEEPSPEED_ROLES):
                self._restore_tracking_reference()

        out = self.recovering(lambda: sync_weights(self.cluster, version, step, kl), again, send_weights=False)
        self.version, self.last_move = version, (step, kl)
        if self.log and self.cluster.reference is not None and self.cluster.reference.tracks:
            self.log[-1] = self.log[-1]._replace(moved=(step, kl))
        if self.snapshot_due():
            out.update(self.take_snapshot())
        elif self._reference_workers_track() and self.snapshot is not None:  # they moved: their state, every step
            self.snapshot = self.snapshot._replace(
                reference=self.recovering(lambda: snapshot_reference(self.cluster), self._move_again))
        return out

    def _move_again(self, role: Optional[str]) -> None:
        """After a tracking reference worker died once the step's move was made (while its state
        was snapshotted): its replacement holds the state before the move, so every copy goes
        back there and the step's move is made once more (the sync sent again)."""
        if role == "reference" and self._reference_workers_track():
            restore_reference_workers(self.cluster, self.snapshot)
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

    def save(self, path: str, state: TrainState) -> str:
        """``save_cluster_checkpoint``; a trainer or critic that dies writing is rebuilt, and the
        checkpoint written again."""
        return self.recovering(lambda: save_cluster_checkpoint(self.cluster, path, state))

    def load(self, path: str) -> TrainState:
        state = load_cluster_checkpoint(self.cluster, path)
        self.version = state.policy_version
        self.snapshot, self.log = None, []  # the next one is of the loaded state
        return state

    # ------------------------------------------------------------------ snapshots
    def prepare_recovery(self) -> None:
        """Snapshot the stateful roles as they are before the first step (after an SFT stage, a
        checkpoint load, the critic's creation), unless snapshots are off or one is current."""
        if self.snapshot_every != 0 and (self.snapshot is None or self.log):
            self.take_snapshot()

    def take_snapshot(self) -> dict:
        """A new in-memory snapshot of the trainer and critic ranks (and the reference workers);
        the log of updates starts again. Returns ``faults/snapshot_s`` and ``faults/snapshot_mb``."""
        before = self.snapshot
        fresh_reference = self._reference_workers_track() or (before is None and self._has_reference_workers())
        if before is None:  # nothing to recover a group from yet
            self.snapshot = take_snapshot(self.cluster, fresh_reference)
        else:  # the old snapshot and the log still hold the state: a rank that dies is recovered from them
            self.snapshot = self.recovering(lambda: take_snapshot(self.cluster, fresh_reference), self._move_again)
        if not fresh_reference and before is not None:  # a fixed reference: its state once
            self.snapshot = self.snapshot._replace(reference=before.reference)
        self.log, self.snapshot_at = [], time.perf_counter()
        self.snapshot_costs.append((self.snapshot.seconds, self.snapshot.nbytes))
        return {"faults/snapshot_s": self.snapshot.seconds, "faults/snapshot_mb": self.snapshot.nbytes / 2 ** 20}

    def _has_reference_workers(self) -> bool:
        return self.cluster.reference is not None and self.cluster.reference.where == "workers"

    def _reference_workers_track(self) -> bool:
        """Reference workers that move every step: their state is snapshotted after every sync."""
        return self._has_reference_workers() and self.cluster.reference.tracks

    def _restore_tracking_reference(self) -> None:
        """After a failed sync: a tracking reference may have moved on some ranks; every copy goes
        back to before the step's move (workers: the snapshot, taken after every move; on the
        trainers: the trainer ranks' snapshot and log, without the step's move)."""
        ref = self.cluster.reference
        if ref is None or not ref.tracks or self.snapshot is None:
            return
        if ref.where == "workers":
            restore_reference_workers(self.cluster, self.snapshot)
        else:
            restore_group(self.cluster, "trainer", self.snapshot, self.log)

    def fault_metrics(self) -> dict:
        """``faults/restarts/<role>`` (actors replaced or groups rebuilt so far) and
        ``faults/seconds_lost`` (failed attempts and recoveries, so far)."""
        out = {"faults/seconds_lost": sum(f["seconds"] + f["lost"] for f in self.faults)}
        for f in self.faults:
            key = f"faults/restarts/{f['role']}"
            out[key] = out.get(key, 0.0) + 1.0
        return out

    # ------------------------------------------------------------------ idle clocks
    def busy(self) -> dict:
        """Seconds each role worked since the last call (generators: the mean over workers)."""
        c, out = self.cluster, {}
        for role, calls, combine in (("generators", c.generators.busy(), lambda xs: sum(xs) / len(xs)),
                                     ("trainers", fan_out(c.trainers, "busy"), max)):
            seconds = []
            for one in calls:
                try:
                    seconds.append(gather([one], c.timeout_s)[0])
                except ActorFailure:
                    pass  # a dead actor: replaced when its next work fails
            if seconds:
                out[role] = combine(seconds)
        return out

    # ------------------------------------------------------------------ elastic generators
    @property
    def generator_count(self) -> int:
        return self.cluster.generators.size

    def scale_generators(self, n: int, in_flight: Sequence = ()) -> dict:
        """Grow or shrink the generator workers to ``n`` between steps, without a restart. The
        generation of the collections ``in_flight`` (``cluster.loop.train.Collection``) finishes
        first where it runs (its rollouts stay in the object store: none is lost or generated
        twice); surplus workers then leave, new ones join the weight broadcast and receive the
        current weights before their first rollout. Returns ``generators/count`` and
        ``time/scale``."""
        import ray

        from cluster.ray_wing.handles import GeneratorWorkers
        from cluster.ray_wing.roles import scale_generator_group

        c = self.cluster
        if not isinstance(c.generators, GeneratorWorkers):
            raise ValueError("generation runs on the trainer ranks (cluster.generate_on_trainers): there are no "
                             "generator workers to scale")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"scale_generators: the count must be an int >= 1, got {n!r}")
        before, t0 = c.generators.size, time.perf_counter()
        if n != before:
            restarts = self.restarts
            self.settle(in_flight)
            unfinished = [call for coll in in_flight for call in coll.handle.phases[0][1] if call.rank >= n]
            if unfinished and ray.wait([x.ref for x in unfinished], num_returns=len(unfinished), timeout=0,
                                       fetch_local=False)[1]:
                raise ActorFailure(f"generator workers {sorted({x.rank for x in unfinished})} still generate after "
                                   f"{c.timeout_s:.0f}s; they cannot leave before their rollouts are done (raise "
                                   "cluster.call_timeout_s if the work is simply long)", "generator",
                                   unfinished[0].rank)
            self.cluster = scale_generator_group(self.cluster, n)
            # new workers hold no weights yet, nor does one that settle() replaced (it waits for the next sync):
            # the broadcast reaches them all; kept workers that were never replaced hold these weights already
            if n > before or self.restarts > restarts:
                sync_weights(self.cluster, self.version, move_reference=False)
            tqdm.write(f"generator workers: {before} -> {n} ({time.perf_counter() - t0:.1f} s)")
        return {"generators/count": float(n), "time/scale": time.perf_counter() - t0}

    # ------------------------------------------------------------------ recovery
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
        * A trainer or critic rank: its whole group is rebuilt (``roles.rebuild_group``); then
          both groups are restored to the snapshot and the updates of the log made again, so
          they hold the state after the last finished update; a rebuilt trainer group's hosted
          generators get the version.
        * Actors that did not answer in time together (a collective: the stuck one and the
          peers waiting for it; which is which cannot be told from outside) are all replaced.

        Returns the last role recovered (a reference on the trainer ranks is the trainers'),
        None when nothing was to do. Re-raises a failure that is not of a dead or stuck actor
        (a user function that raised), or that exceeds ``max_actor_restarts``, or of a
        trainer, critic or reference when no snapshot is kept."""
        for _ in range(self.max_actor_restarts + 1):
            try:
                return self._recover_targets(failure, since, send_weights, lost)
            except ActorFailure as nested:  # another actor died or hung while this one was being recovered
                if nested is failure or not nested.replaceable:
                    raise
                tqdm.write(f"{nested}\n(while recovering from: {failure})")
                self.recover(nested, since=self.restarts, send_weights=send_weights)
                since, lost = self.restarts, 0.0  # then this recovery again, from the start
        raise failure

    def _recover_targets(self, failure: ActorFailure, since: int, send_weights: bool, lost: float) -> Optional[str]:
        if not failure.replaceable:
            raise failure
        targets = failure.late if failure.stuck and not failure.died else ((failure.role, failure.rank),)
        if failure.actor_id:  # the actor that died (the call may have read its result)
            where = self.locate(failure.actor_id)
            if where is None:
                return None  # one replaced already: only the work is redone
            targets = (where,)
        done = None
        for role, rank in _single_actors_first(targets, self.cluster.reference):
            if role in RECOVERABLE_ROLES:
                done = self._recover_one(failure, role, rank, since, send_weights, lost) or done
        return done

    def _recover_one(self, failure: ActorFailure, role: str, rank: int, since: int, send_weights: bool,
                     lost: float) -> Optional[str]:
        if role == "generator" and rank >= self.cluster.generators.size:
            return None  # a worker that left when the generators shrank: only its work is redone, on those left
        key = (role, -1 if role in DEEPSPEED_ROLES else rank)  # a DeepSpeed group is rebuilt whole
        if self.replaced_at.get(key, -1) > since:
            return None  # already replaced since the work was dispatched: only the work is redone
        if self.restarts >= self.max_actor_restarts:
            raise ActorFailure(f"{failure} (after {self.restarts} recoveries, cluster.max_restarts)", failure.role,
                               rank, failure.died, failure.stuck, final=True) from failure
        if (role in DEEPSPEED_ROLES or role == "reference") and self.snapshot is None:
            raise ActorFailure(f"{failure} (no snapshot yet to restore a {role} from: one is taken when training "
                               "starts, none with cluster.snapshot_every 0)",
                               failure.role, rank, failure.died, failure.stuck, final=True) from failure
        self.restarts += 1
        self.replaced_at[key] = self.restarts
        stuck = failure.stuck and not failure.died
        tqdm.write(f"{failure}\n{role} {rank} {'stopped answering: killing it' if stuck else 'died'}; "
                   f"{'rebuilding the ' + role + ' group' if role in DEEPSPEED_ROLES else 'replacing it'} "
                   "and doing its work again")
        t0 = time.perf_counter()
        record = {"role": role, "rank": rank, "stuck": stuck, "lost": lost, "version": self.version}
        try:
            if role in DEEPSPEED_ROLES:
                self.cluster = rebuild_group(self.cluster, role)
                self._restore_groups()
            else:
                self.cluster = replace_actor(self.cluster, role, rank)
                if role == "reference":
                    gather([call(self.cluster.reference.group, rank, "restore", self.snapshot.reference)],
                           self.cluster.timeout_s)
                if role == "generator" and send_weights:
                    sync_weights(self.cluster, self.version, move_reference=False)
        except BaseException as error:  # a recovery that failed counts too: the summary shows what it cost
            self.faults.append({**record, "seconds": time.perf_counter() - t0, "replayed": 0,
                                "failed": f"{type(error).__name__}: {error}"[:300]})
            raise
        seconds = time.perf_counter() - t0
        self.faults.append({**record, "seconds": seconds, "replayed": len(self.log)})
        tqdm.write(f"{role} {rank}: recovered in {seconds:.1f} s")
        return role

    def locate(self, dead_id: str) -> Optional[tuple]:
        """``(role, rank)`` of the actor with id ``dead_id`` in the cluster as it is now; None
        when no current actor has it (it was replaced already)."""
        c = self.cluster
        groups = [getattr(c.generators, "group", None), c.rewards, getattr(c.reference, "group", None), c.trainers,
                  c.critics]
        for group in groups:
            for rank, actor in enumerate(group.actors if group is not None else ()):
                if actor_id(actor) == dead_id:
                    return group.role, rank
        return None

    def fault_summary(self) -> dict:
        """What the run survived, for its summary: each recovery (role, rank, stuck or dead, the
        policy version it happened at, seconds to recover, updates made again; ``failed``, the
        error, for an attempt that did not succeed), restarts (attempts) and failed attempts by
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
        restore_group(self.cluster, "trainer", self.snapshot, self.log)
        if self.cluster.critics is not None:
            restore_group(self.cluster, "critic", self.snapshot, self.log)
        if self.cluster.generators.where == "trainers":  # generators hosted by rebuilt ranks: the version they hold
            gather(self.cluster.generators.receive_weights((), 0, self.version), self.cluster.timeout_s)

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
        for ping in self.cluster.generators.ping():
            try:
                gather([ping], self.cluster.timeout_s)
            except ActorFailure as failure:
                if failure.died:
                    self.recover(failure, since=self.restarts, send_weights=False)
