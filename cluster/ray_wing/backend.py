"""The Ray backend of the loops (``cluster.loop.protocol``): the operations on the actors of an
``RLCluster``.

Rollouts move between actors as ObjectRefs and never through the driver: ``generate``,
``reference_logprobs`` and ``score`` chain calls without waiting; ``fetch`` waits for them,
phase by phase, timing each, and fetches only the reward workers' summaries; the trainer
(and critic) ranks receive the chunks by reference and build the step's batch themselves. A
dead or failing actor surfaces as an ``ActorFailure`` that names its role and rank;
``recover`` replaces a dead generator or reward worker, and the loop generates the lost
prompts again.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import NamedTuple, Optional, Sequence

from tqdm import tqdm

from cluster.loop.protocol import ActorFailure, Held, StepResult, plan_parts
from cluster.ray_wing.groups import call, call_split, fan_out, gather, split_evenly
from cluster.ray_wing.roles import RLCluster, replace_actor
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
    together (no error checks: ``gather`` names failures afterwards)."""
    import ray

    t0, left, done = time.perf_counter(), {name: {c.ref for c in calls} for name, calls in phases}, {}
    pending = [c.ref for _, calls in phases for c in calls]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s, fetch_local=False)
        if not ready:
            break
        for name, refs in left.items():
            refs.difference_update(ready)
            if not refs and name not in done:
                done[name] = time.perf_counter() - t0
    return {name: done.get(name, time.perf_counter() - t0) for name, _ in phases}


class RayBackend:
    """The RL loop's operations on a Ray cluster (see ``cluster.loop.train.train``).

    ``cluster`` is replaced when an actor is (``recover``); read it from here afterwards."""

    name = "ray"
    remote = True  # functions travel to the actors: they must pickle

    def __init__(self, cluster: RLCluster, max_actor_restarts: int = 3):
        self.cluster, self.max_actor_restarts, self.restarts = cluster, max_actor_restarts, 0
        self.replaced_at: dict = {}  # (role, rank) -> the restarts count its last replacement made
        self.version = 0  # the policy version the generators hold (the last sync's)

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
        return RolloutRefs(refs.phases, (("ref", ref), ("reward", reward)),
                           tuple((d, r.ref) for d, r in zip(data, ref)))

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
        try:
            chunks = gather(summary_calls, self.cluster.timeout_s)
        except ActorFailure:
            for _, calls in phases:  # the earliest failure names its actor
                gather(calls, self.cluster.timeout_s)
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
        reference."""
        c = self.cluster
        trailing = [*flat_parts(parts), *[v.ref for v in values or ()]]
        calls = fan_out(c.trainers, "train_planned", plan, algo, temperature, lr, len(parts), *trailing)
        critic_calls = fan_out(c.critics, "value_step_planned", plan, algo, len(parts), *trailing) \
            if with_critic else []  # at the critic's lr
        results = gather(calls + list(values or ()) + critic_calls, c.timeout_s)
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
        out = sync_weights(self.cluster, version, step, kl)
        self.version = version
        return out

    def save(self, path: str, state: TrainState) -> str:
        return save_cluster_checkpoint(self.cluster, path, state)

    def load(self, path: str) -> TrainState:
        state = load_cluster_checkpoint(self.cluster, path)
        self.version = state.policy_version
        return state

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
            self.settle(in_flight)
            unfinished = [call for coll in in_flight for call in coll.handle.phases[0][1] if call.rank >= n]
            if unfinished and ray.wait([x.ref for x in unfinished], num_returns=len(unfinished), timeout=0,
                                       fetch_local=False)[1]:
                raise ActorFailure(f"generator workers {sorted({x.rank for x in unfinished})} still generate after "
                                   f"{c.timeout_s:.0f}s; they cannot leave before their rollouts are done (raise "
                                   "cluster.call_timeout_s if the work is simply long)", "generator",
                                   unfinished[0].rank)
            self.cluster = scale_generator_group(self.cluster, n)
            if n > before:  # the kept ones hold these weights already; the broadcast reaches all
                sync_weights(self.cluster, self.version, move_reference=False)
            tqdm.write(f"generator workers: {before} -> {n} ({time.perf_counter() - t0:.1f} s)")
        return {"generators/count": float(n), "time/scale": time.perf_counter() - t0}

    # ------------------------------------------------------------------ recovery
    def recover(self, failure: ActorFailure, since: int, send_weights: bool = True) -> None:
        """Replace the dead generator or reward worker of ``failure`` (a new generator receives
        the current weights, labelled with the last sync's version, unless ``send_weights`` is
        false: the next sync brings them),
        unless it was replaced after ``since`` (a ``restarts`` count) already; re-raise a
        failure that is not a dead, replaceable actor or exceeds ``max_actor_restarts``."""
        if not failure.replaceable:
            raise failure
        if failure.role == "generator" and failure.rank >= self.cluster.generators.size:
            return  # a worker that left when the generators shrank: only its work is redone, on those left
        if self.replaced_at.get((failure.role, failure.rank), -1) > since:
            return  # already replaced since the work was dispatched: only the work is redone
        if self.restarts >= self.max_actor_restarts:
            raise failure
        self.restarts += 1
        self.replaced_at[(failure.role, failure.rank)] = self.restarts
        tqdm.write(f"{failure}; replacing it and generating its prompts again")
        self.cluster = replace_actor(self.cluster, failure.role, failure.rank)
        if failure.role == "generator" and send_weights:
            sync_weights(self.cluster, self.version, move_reference=False)

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
