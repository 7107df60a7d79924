"""Role handles: each role (generators, reference) is built once, where it lives - actors of its
own, or hosted on the trainer ranks - and offers the same operations either way, each a call
to a named actor method. The Ray backend calls the operations and never asks where a role is.

Every operation returns ``Call``s in flight (``groups.gather`` waits for them).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from cluster.ray_wing.groups import Call, WorkerGroup, call, call_split, fan_out


def generate_call(group: WorkerGroup, rank: int, items: Sequence, gen, tools=None) -> Call:
    """Rollouts of ``items`` on ``group``'s rank ``rank`` (both kinds of generator actor offer
    ``generate`` and, with ``tools``, ``generate_multiturn``)."""
    if tools is None:
        return call(group, rank, "generate", items, gen)
    return call(group, rank, "generate_multiturn", items, gen, tools)


class GeneratorWorkers(NamedTuple):
    """Generator workers of their own: they join the weight-sync broadcast, and a dead one is
    replaced alone."""

    group: WorkerGroup

    @property
    def where(self) -> str:
        return "workers"

    @property
    def size(self) -> int:
        return self.group.size

    def generate(self, rank: int, items: Sequence, gen, tools=None) -> Call:
        return generate_call(self.group, rank, items, gen, tools)

    def join_sync(self, address, first_rank: int, bucket_bytes: int) -> list:
        """Each worker joins the sync group as ``first_rank + its rank``."""
        return [call(self.group, i, "init_weight_sync", address, first_rank + i, bucket_bytes)
                for i in range(self.size)]

    def sync_ranks(self) -> int:
        return self.size

    def receive_weights(self, meta: Sequence, bucket_bytes: int, version: int) -> list:
        return fan_out(self.group, "receive_weights", meta, bucket_bytes, version)

    def busy(self) -> list:
        return fan_out(self.group, "busy")

    def ping(self) -> list:
        return fan_out(self.group, "pad_token_id")

    def info(self) -> list:
        return fan_out(self.group, "info")


class GeneratorsOnTrainers(NamedTuple):
    """Generation on the trainer ranks (``cluster.generate_on_trainers``), each with the module it
    trains: nothing to broadcast, a sync only stamps the version; a failure is the trainer's (its
    group is rebuilt)."""

    trainers: WorkerGroup

    @property
    def where(self) -> str:
        return "trainers"

    @property
    def size(self) -> int:
        return self.trainers.size

    def generate(self, rank: int, items: Sequence, gen, tools=None) -> Call:
        return generate_call(self.trainers, rank, items, gen, tools)

    def join_sync(self, address, first_rank: int, bucket_bytes: int) -> list:
        return []

    def sync_ranks(self) -> int:
        return 0

    def receive_weights(self, meta: Sequence, bucket_bytes: int, version: int) -> list:
        return fan_out(self.trainers, "generator_version", version)

    def busy(self) -> list:
        return fan_out(self.trainers, "generator_busy")

    def ping(self) -> list:
        return fan_out(self.trainers, "pad_token_id")

    def info(self) -> list:
        return fan_out(self.trainers, "generator_info")


class ReferenceWorkers(NamedTuple):
    """Reference workers of their own (``cluster.reference_workers``); with ``tracks`` (a
    ``ref_update_fn``) they join the weight-sync broadcast and move at each RL step's sync."""

    group: WorkerGroup
    tracks: bool = False

    @property
    def where(self) -> str:
        return "workers"

    @property
    def in_train_step(self) -> bool:
        """The rollouts are scored before the batch is made."""
        return False

    @property
    def size(self) -> int:
        return self.group.size

    def logprobs(self, i: int, rollouts, temperature: float) -> tuple:
        """``(Call of the count, ref of the arrays)``: reference logprobs ``(T_i,)`` of a chunk of
        rollouts (chunk ``i`` goes to rank ``i mod size``); the driver waits for the count only."""
        return call_split(self.group, i % self.size, "logprobs_counted", rollouts, temperature)

    def with_ref_logprobs(self, i: int, rollouts, temperature: float) -> Call:
        """The chunk's rollouts with ``ref_logprobs`` set."""
        return call(self.group, i % self.size, "with_ref_logprobs", rollouts, temperature)

    def join_sync(self, address, first_rank: int) -> list:
        return [call(self.group, r, "init_weight_sync", address, first_rank + r) for r in range(self.sync_ranks())]

    def sync_ranks(self) -> int:
        return self.size if self.tracks else 0

    def sync(self, meta: Sequence, bucket_bytes: int, step: int, kl: Optional[float], move: bool) -> list:
        """Its part of a weight sync: a tracking reference reads the broadcast (and moves when
        ``move``)."""
        return fan_out(self.group, "receive_weights", meta, bucket_bytes, step, kl, move) if self.tracks else []

    def copy_policy(self, trainers: WorkerGroup) -> list:
        """Every rank becomes the policy: trainer rank 0's weights by ref (never through the
        driver); the other trainer ranks join the ZeRO-3 gathers."""
        states = fan_out(trainers, "full_state", True)
        return [call(self.group, r, "load_weights", states[0].ref) for r in range(self.size)] + states[1:]

    def save(self, path: str) -> Call:
        return call(self.group, 0, "save_weights", path)  # every copy is the same

    def load(self, path: str) -> list:
        return fan_out(self.group, "load_weights_from", path)


class ReferenceOnTrainers(NamedTuple):
    """A reference copy on every trainer rank (``cluster.reference_on_trainers``): each rank
    scores its own shard in the train step; before the batch is made (KL in the reward) any
    rank scores any chunk."""

    trainers: WorkerGroup
    tracks: bool = False

    @property
    def where(self) -> str:
        return "trainers"

    @property
    def in_train_step(self) -> bool:
        """Each rank scores its own shard in the train step."""
        return True

    @property
    def size(self) -> int:
        return self.trainers.size

    def logprobs(self, i: int, rollouts, temperature: float) -> tuple:
        return call_split(self.trainers, i % self.size, "reference_logprobs_counted", rollouts, temperature)

    def with_ref_logprobs(self, i: int, rollouts, temperature: float) -> Call:
        return call(self.trainers, i % self.size, "with_reference_logprobs", rollouts, temperature)

    def join_sync(self, address, first_rank: int) -> list:
        return []

    def sync_ranks(self) -> int:
        return 0

    def sync(self, meta: Sequence, bucket_bytes: int, step: int, kl: Optional[float], move: bool) -> list:
        """It reads the policy where it is: a tracking copy moves (calls to one actor run in
        order, so after the broadcast)."""
        return fan_out(self.trainers, "move_reference", step, kl) if self.tracks and move else []

    def copy_policy(self, trainers: WorkerGroup) -> list:
        return fan_out(self.trainers, "copy_policy_to_reference")

    def save(self, path: str) -> Call:
        return call(self.trainers, 0, "save_reference", path)

    def load(self, path: str) -> list:
        return fan_out(self.trainers, "load_reference_from", path)
