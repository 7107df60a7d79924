"""The Ray backend of the RL loop: the step's operations on the actors of an ``RLCluster``.

Rollouts move between actors as ObjectRefs: ``generate``, ``reference_logprobs`` and
``score`` chain calls without waiting, and ``fetch`` is the one place that waits for them,
phase by phase, timing each. A dead or failing actor surfaces as an ``ActorFailure`` that
names its role and rank; ``retry`` replaces a dead generator or reward worker and runs the
work again with the same inputs.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable, NamedTuple, Optional, Sequence

from tqdm import tqdm

from cluster.groups import ActorFailure, call, fan_out, fan_out_each, gather, split_evenly
from cluster.setup import RLCluster, replace_actor
from primitives.checkpoint import state_from_json, state_to_json
from primitives.types import GenerationConfig, TrainState


def _flat(lists) -> list:
    return [x for chunk in lists for x in chunk]


def sync_weights(cluster: RLCluster, version: int, step: int = 0, kl: Optional[float] = None) -> dict:
    """Broadcast the trainers' weights to every generator (and a tracking reference)."""
    t0 = time.perf_counter()
    meta, bucket = list(cluster.weight_meta), cluster.bucket_bytes
    calls = fan_out(cluster.trainers, "send_weights", meta, bucket)
    calls += fan_out(cluster.generators, "receive_weights", meta, bucket, version)
    if cluster.reference_tracks_policy:
        calls += fan_out(cluster.reference, "receive_weights", meta, bucket, step, kl)
    moved = gather(calls, cluster.timeout_s)[0]
    dt = time.perf_counter() - t0
    return {"time/sync": dt, "sync/bytes": float(moved), "sync/version": float(version)}


def copy_policy_to_reference(cluster: RLCluster) -> None:
    """Make the reference equal to the current policy (after SFT, say). Rank 0's weights go
    to the reference by ref, never through the driver; the other ranks join ZeRO-3 gathers."""
    if cluster.reference is None:
        return
    states = fan_out(cluster.trainers, "full_state", True)
    gather([call(cluster.reference, 0, "load_weights", states[0].ref)] + states[1:], cluster.timeout_s)


def save_cluster_checkpoint(cluster: RLCluster, path: str, state: TrainState) -> str:
    """Trainer shards with optimizer and RNG, an HF copy, the reference weights and the
    ``TrainState`` (data position, versions, metrics), written atomically to ``path``."""
    extra = {}
    if cluster.critics is not None:  # the critic's shards and HF copy, moved in by trainer rank 0
        critic_tmp = path.rstrip("/") + ".critic.tmp"
        shutil.rmtree(critic_tmp, ignore_errors=True)
        gather(fan_out(cluster.critics, "save_checkpoint", critic_tmp), cluster.timeout_s)
        extra["critic"] = critic_tmp
    if cluster.reference is not None:
        ref_tmp = path.rstrip("/") + ".reference.tmp"
        shutil.rmtree(ref_tmp, ignore_errors=True)
        gather([call(cluster.reference, 0, "save_weights", ref_tmp)], cluster.timeout_s)
        extra["reference"] = ref_tmp
    gather(fan_out(cluster.trainers, "save_checkpoint", path, state_to_json(state), extra), cluster.timeout_s)
    return path


def load_cluster_checkpoint(cluster: RLCluster, path: str) -> TrainState:
    """Restore what ``save_cluster_checkpoint`` wrote and send the weights to the generators;
    training continues exactly where it stopped."""
    saved = gather(fan_out(cluster.trainers, "load_checkpoint", path), cluster.timeout_s)[0]
    state = state_from_json(saved)
    if cluster.reference is not None and os.path.isdir(os.path.join(path, "reference")):
        gather([call(cluster.reference, 0, "load_weights_from", os.path.join(path, "reference"))], cluster.timeout_s)
    if cluster.critics is not None:
        if not os.path.isdir(os.path.join(path, "critic")):
            raise FileNotFoundError(f"{path} holds no critic/ to resume the critic from")
        gather(fan_out(cluster.critics, "load_checkpoint", os.path.join(path, "critic")), cluster.timeout_s)
    if cluster.generators is not None:  # an SFT job has no generators
        sync_weights(cluster, state.policy_version)
    return state


class RolloutRefs(NamedTuple):
    """Rollouts in flight: the calls of each phase so far, in order (the last holds them)."""

    phases: tuple  # ((phase name, [Call, ...]), ...)

    def then(self, name: str, calls: list) -> "RolloutRefs":
        return RolloutRefs(self.phases + ((name, calls),))


class RayBackend:
    """The RL loop's operations on a Ray cluster (see ``cluster.driver.train``).

    ``cluster`` is replaced when an actor is (``retry``); read it from here afterwards."""

    name = "ray"

    def __init__(self, cluster: RLCluster, max_actor_restarts: int = 3):
        self.cluster, self.max_actor_restarts, self.restarts = cluster, max_actor_restarts, 0

    @property
    def pad_token_id(self) -> int:
        return self.cluster.pad_token_id

    @property
    def has_reference(self) -> bool:
        return self.cluster.reference is not None

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
        c = self.cluster
        chunks = split_evenly(list(items), c.generators.size)
        method, extra = ("generate", ()) if tools is None else ("generate_multiturn", (tools,))
        calls = fan_out_each(c.generators, method, [(chunk, gen, *extra) if chunk else None for chunk in chunks])
        return RolloutRefs((("generate", calls),))

    def reference_logprobs(self, refs: RolloutRefs, temperature: float) -> RolloutRefs:
        """Reference logprobs of the rollouts, at the sampling temperature."""
        c = self.cluster
        return refs.then("ref", [call(c.reference, 0, "logprobs", x.ref, temperature) for x in refs.phases[-1][1]])

    def score(self, refs: RolloutRefs) -> RolloutRefs:
        """Rewards of the rollouts, the chunks spread over the reward workers."""
        c = self.cluster
        return refs.then("reward", [call(c.rewards, i % c.rewards.size, "score", x.ref)
                                    for i, x in enumerate(refs.phases[-1][1])])

    def fetch(self, refs: RolloutRefs) -> tuple:
        """``(rollouts, {"time/<phase>": seconds})``: waits phase by phase."""
        times, out = {}, []
        t = time.perf_counter()
        for name, calls in refs.phases:
            out = gather(calls, self.cluster.timeout_s)
            now = time.perf_counter()
            times[f"time/{name}"] = now - t
            t = now
        return _flat(out), times

    def values(self, rollouts: Sequence) -> list:
        """The critic's values of each rollout's completion tokens, (T_i,) each."""
        import ray

        c = self.cluster
        if not self.has_critic:
            raise ValueError("this cluster has no critic; build it with a critic for an algorithm whose "
                             "advantage function reads values (PPO's GAE)")
        ref = ray.put(list(rollouts))
        return _flat(gather(fan_out(c.critics, "values_share", ref), c.timeout_s))

    # ------------------------------------------------------------------ training
    def train_step(self, batch, algo, temperature: float, lr: Optional[float], critic: bool = False) -> tuple:
        """One rollout batch on every trainer rank (and the critic ranks when ``critic``),
        concurrently; ``(policy per-rank updates, critic per-rank updates or None)``."""
        import ray

        c = self.cluster
        batch_ref = ray.put(batch)
        calls = fan_out(c.trainers, "train_step", batch_ref, algo, temperature, lr)
        critic_calls = fan_out(c.critics, "value_step", batch_ref, algo) if critic else []  # at the critic's lr
        results = gather(calls + critic_calls, c.timeout_s)
        return results[: len(calls)], (results[len(calls):] if critic else None)

    def sync(self, version: int, step: int, kl: Optional[float]) -> dict:
        return sync_weights(self.cluster, version, step, kl)

    def save(self, path: str, state: TrainState) -> str:
        return save_cluster_checkpoint(self.cluster, path, state)

    def load(self, path: str) -> TrainState:
        return load_cluster_checkpoint(self.cluster, path)

    # ------------------------------------------------------------------ recovery
    def retry(self, work: Callable[[], tuple], version: int):
        """``work()``; if a generator or reward worker died, replace it (a new generator first
        receives the weights of ``version``) and run ``work`` again with the same inputs."""
        while True:
            try:
                return work()
            except ActorFailure as failure:
                if not failure.replaceable or self.restarts >= self.max_actor_restarts:
                    raise
                self.restarts += 1
                tqdm.write(f"{failure}; replacing it and running the step's collection again")
                self.cluster = replace_actor(self.cluster, failure.role, failure.rank)
                if failure.role == "generator":
                    sync_weights(self.cluster, version)
