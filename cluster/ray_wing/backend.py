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
the in-memory snapshot and the log of updates since (``cluster.ray_wing.snapshots``, ``.recovery``), so the
run goes on with the weights an undisturbed run has.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional, Sequence

from tqdm import tqdm

from cluster.loop.protocol import ActorFailure, Held, StepResult, plan_parts
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
from cluster.ray_wing.recovery import Recovery
from cluster.ray_wing.roles import DEEPSPEED_ROLES, RLCluster
from cluster.ray_wing.snapshots import SFTUpdate, Snapshot, Update, snapshot_reference
from cluster.ray_wing.weights import load_cluster_checkpoint, save_cluster_checkpoint, sync_weights
from primitives.types import BatchPlan, GenerationConfig, TrainState, planned_rollouts


def _flat(lists) -> list:
    return [x for chunk in lists for x in chunk]


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


def job_backend(cluster: RLCluster, cfg) -> "RayBackend":
    """The backend of a job's cluster, with the job's recovery settings (``cluster`` section:
    ``max_restarts``, ``snapshot_every``, ``snapshot_overhead``)."""
    return RayBackend(cluster, max_actor_restarts=cfg.max_restarts, snapshot_every=cfg.snapshot_every,
                      snapshot_overhead=cfg.snapshot_overhead)


class RayBackend(Recovery):
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
        self.kept = [0, 0.0]  # bytes and seconds of results copied to the driver's node (custody.keep_here)
        self._prompt_tokens: dict = {}  # a vLLM generator's actor id -> its prompt token counts at the last read

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
        generators = self.cluster.generator_handle
        chunks = split_evenly(list(items), generators.size)
        return RolloutRefs((("generate", [generators.generate(r, chunk, gen, tools)
                                          for r, chunk in enumerate(chunks) if chunk]),))

    def reference_logprobs(self, refs: RolloutRefs, temperature: float) -> RolloutRefs:
        """Reference logprobs of the rollouts, at the sampling temperature."""
        chunks = [x.ref for x in refs.phases[-1][1]]
        return refs.then("ref", [self.cluster.reference_handle.with_ref_logprobs(i, x, temperature)
                                 for i, x in enumerate(chunks)])

    def _score(self, chunks: Sequence, shaped: bool = True) -> tuple:
        """``(summary calls, scored-rollout refs)`` of each chunk, spread over the reward workers."""
        rewards = self.cluster.reward_group
        split = [call_split(rewards, i % rewards.size, "score_summarized", x, shaped) for i, x in enumerate(chunks)]
        return [s for s, _ in split], [d for _, d in split]

    def score(self, refs: RolloutRefs, shaped: bool = True) -> RolloutRefs:
        """Rewards of the rollouts (``shaped`` False: without the shaping function), the chunks spread
        over the reward workers."""
        calls, data = self._score([x.ref for x in refs.phases[-1][1]], shaped)
        return refs.then("reward", calls, tuple((d, None) for d in data))

    def score_and_reference(self, refs: RolloutRefs, temperature: float) -> RolloutRefs:
        """Rewards and reference logprobs of the rollouts side by side (neither reads the
        other): the chunks go to the reward workers and the reference workers at once, the
        reference returning only its logprob arrays."""
        chunks = [x.ref for x in refs.phases[-1][1]]
        ref = [self.cluster.reference_handle.logprobs(i, x, temperature) for i, x in enumerate(chunks)]
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
            parts = self.keep([x for part in refs.parts for x in part],
                              [c for c in summary_calls for _ in range(2)])  # each part's data and reference arrays
        except ActorFailure:
            for _, calls in phases:  # the earliest failure names its actor (the chunks stay where they are)
                settle(calls, 0, waited)
            raise
        with_ref = bool(refs.branches)  # the reference's arrays join the rollouts where they are trained
        return [Held(s._replace(has_ref=True) if with_ref else s, part, i)
                for part, summaries in zip(zip(parts[::2], parts[1::2]), chunks, strict=True)
                for i, s in enumerate(summaries)], times

    def select(self, rows: Sequence, filters: Sequence) -> list:
        """The rows ``filters`` keep, in their order: the filters run on a reward worker, which
        receives the rows' chunks by reference, and only positions come back."""
        positions, parts = plan_parts(rows)
        kept = gather([call(self.cluster.reward_group, 0, "select", tuple(filters), positions, len(parts),
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
        return fan_out(c.critic_group, "values_planned", plan, len(parts), *flat_parts(parts))

    # ------------------------------------------------------------------ training
    def train_step(self, plan: BatchPlan, parts: list, values: Optional[list], algo, temperature: float,
                   lr: Optional[float], with_critic: bool = False) -> StepResult:
        """The planned batch on every trainer rank (and the critic ranks when ``with_critic``),
        concurrently; each rank builds the batch from the parts and value shares it receives by
        reference. If a rank of either group dies or stops answering, its group is rebuilt,
        both groups are restored to the state before the step (``recover``), the value shares
        are computed again and the step is made again with the same rollouts."""
        parts, inputs = [tuple(p) for p in parts], {"values": values}
        kept: dict = {"shares": ()}  # the value shares the log replays

        def again(roles: set) -> None:  # the value shares of a dead critic are lost: computed again
            if values is not None:
                inputs["values"] = self.values(plan, parts)

        logged = self.snapshot_every != 0  # without snapshots nothing replays the step

        def step() -> StepResult:
            result = self._train_call(plan, parts, inputs["values"], algo, temperature, lr, with_critic)
            if logged and result.batch_metrics is not None:  # the shares the log replays, kept off the critic's node
                shares = list(inputs["values"] or ())  # (a loss here: both groups restored and the step made again)
                kept["shares"] = tuple(self.keep([v.ref for v in shares], shares))
            return result

        result = self.recovering(step, again)
        if logged and result.batch_metrics is not None:
            self.log.append(Update(plan, tuple(parts), kept["shares"], algo, temperature, lr, with_critic))
        return result

    def _train_call(self, plan: BatchPlan, parts: list, values: Optional[list], algo, temperature: float,
                    lr: Optional[float], with_critic: bool) -> StepResult:
        c = self.cluster
        trailing = [*flat_parts(parts), *[v.ref for v in values or ()]]
        calls = fan_out(c.trainers, "train_planned", plan, algo, temperature, lr, len(parts), *trailing)
        critic_calls = fan_out(c.critic_group, "value_step_planned", plan, algo, len(parts), *trailing) \
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
        """One SFT step on every trainer rank (each takes its rows of the collated arrays). If a rank
        dies or stops answering, the group is rebuilt, restored to the last snapshot with the SFT
        steps since made again, and the step made again; snapshots are taken as in RL
        (``snapshot_due``), so the steps to make again stay few."""
        import ray

        refs = tuple(ray.put(a) for a in arrays)
        metrics = self.recovering(lambda: gather(fan_out(self.cluster.trainers, "sft_step", *refs, lr),
                                                 self.cluster.timeout_s))
        if self.snapshot_every != 0:
            self.log.append(SFTUpdate(refs, lr))
            if self.snapshot_due():
                self.take_snapshot()
        return metrics

    def sft_eval(self, arrays: tuple) -> list:
        import ray

        c = self.cluster
        return gather(fan_out(c.trainers, "sft_eval", *[ray.put(a) for a in arrays]), c.timeout_s)

    def sync(self, version: int, step: int, kl: Optional[float]) -> dict:
        """The step's weights to the generators (and a tracking reference), then, every
        ``snapshot_every`` steps, a new in-memory snapshot. If an actor dies or stops answering
        during the sync it is replaced (a trainer group rebuilt and brought to the state after
        the step; a tracking reference restored to before its move) and the sync made again."""
        def again(roles: set) -> None:
            # a tracking reference may have moved before the failure: back to before the move (a reference on
            # rebuilt trainer ranks was restored to the step's end, before its move, already; a critic's rebuild
            # restores the trainer ranks too)
            ref = self.cluster.reference
            if ref is not None and ref.tracks and self.snapshot is None:
                raise ActorFailure("a weight sync failed after the tracking reference may have moved, and no "
                                   "snapshot (cluster.snapshot_every 0) can undo the move: the run stops rather "
                                   "than move it twice", "reference", 0, final=True)
            if ref is not None and (ref.where == "workers" or not roles & set(DEEPSPEED_ROLES)):
                self._restore_tracking_reference()

        out = self.recovering(lambda: sync_weights(self.cluster, version, step, kl), again, send_weights=False)
        self.version, self.last_move = version, (step, kl)
        if self.log and self.cluster.reference is not None and self.cluster.reference.tracks:
            self.log[-1] = self.log[-1]._replace(moved=(step, kl))
        if self.snapshot_due():
            out.update(self.take_snapshot())
        elif self._reference_workers_track() and self.snapshot is not None:  # they moved: their state, every step
            self.snapshot = self.snapshot._replace(
                reference=self.recovering(lambda: snapshot_reference(self.cluster, self.keep), self._move_again))
        return out

    def save(self, path: str, state: TrainState) -> str:
        """``save_cluster_checkpoint``; a trainer or critic that dies writing is rebuilt, and the
        checkpoint written again."""
        return self.recovering(lambda: save_cluster_checkpoint(self.cluster, path, state))

    def load(self, path: str) -> TrainState:
        state = load_cluster_checkpoint(self.cluster, path)
        self.version = state.policy_version
        self.snapshot, self.log = None, []  # the next one is of the loaded state
        return state

    # ------------------------------------------------------------------ idle clocks
    def busy(self) -> dict:
        """Seconds each role worked since the last call (generators: the mean over workers)."""
        c, out = self.cluster, {}
        for role, calls, combine in (("generators", c.generator_handle.busy(), lambda xs: sum(xs) / len(xs)),
                                     ("trainers", fan_out(c.trainers, "busy"), max)):
            seconds = [x for x in self._answers(calls) if x is not None]
            if seconds:
                out[role] = combine(seconds)
        return out

    def _answers(self, calls) -> list:
        """Each call's result; None for a dead actor's (replaced when its next work fails)."""
        out = []
        for one in calls:
            try:
                out.append(gather([one], self.cluster.timeout_s)[0])
            except ActorFailure:
                out.append(None)
        return out

    def prefix_cache(self) -> dict:
        """vLLM generator workers' prompt tokens since the last call (``vllm/prompt_tokens``) and
        the share of them vLLM's prefix cache served (``vllm/prefix_cache_share``: a GRPO group's
        samples after its first read the prompt's cached blocks); {} for HF generation, or
        when no prompt was read. A replaced or added worker counts from zero."""
        c = self.cluster
        if c.generator_engine != "vllm" or c.generators is None or c.generators.where != "workers":
            return {}
        group, total, cached = c.generator_workers.group, 0, 0
        for actor, now in zip(group.actors, self._answers(fan_out(group, "prompt_tokens"))):
            if now is None:
                continue
            key = actor_id(actor)
            before = self._prompt_tokens.get(key, (0, 0))
            self._prompt_tokens[key] = tuple(now)
            total, cached = total + now[0] - before[0], cached + now[1] - before[1]
        return {"vllm/prompt_tokens": float(total), "vllm/prefix_cache_share": cached / total} if total else {}

    # ------------------------------------------------------------------ elastic generators
    @property
    def can_scale_generators(self) -> bool:
        from cluster.ray_wing.handles import GeneratorWorkers

        return isinstance(self.cluster.generators, GeneratorWorkers)

    @property
    def generator_count(self) -> int:
        return self.cluster.generator_handle.size

    def scale_generators(self, n: int, in_flight: Sequence = ()) -> dict:
        """Grow or shrink the generator workers to ``n`` between steps, without a restart. The
        generation of the collections ``in_flight`` (``cluster.loop.train.Collection``) finishes
        first where it runs (its rollouts stay in the object store: none is lost or generated
        twice); surplus workers then leave, new ones join the weight broadcast and receive the
        current weights before their first rollout. Returns ``generators/count`` and
        ``time/scale``."""
        import ray

        from cluster.ray_wing.handles import GeneratorWorkers
        from cluster.ray_wing.roles import join_weight_sync, scale_generator_group

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
            self.cluster, before_token = scale_generator_group(self.cluster, n), self.cluster.sync_address.token

            def join_and_send() -> None:  # made again after a recovery of a worker that failed in it
                if self.cluster.sync_address.token == before_token:  # else that recovery formed the group
                    self.cluster = join_weight_sync(self.cluster)
                # new workers hold no weights yet, nor does one replaced since (settle(), or a recovery here):
                # the broadcast reaches them all; kept workers that were never replaced hold these weights already
                if n > before or self.restarts > restarts:
                    sync_weights(self.cluster, self.version, move_reference=False)

            self.recovering(join_and_send, send_weights=False)
            tqdm.write(f"generator workers: {before} -> {n} ({time.perf_counter() - t0:.1f} s)")
        return {"generators/count": float(n), "time/scale": time.perf_counter() - t0}

