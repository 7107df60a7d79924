"""The backend protocol: what the loops (``cluster.loop.train``, ``cluster.loop.sft``) call, and
what each call returns. Two backends implement it - ``cluster.ray_wing.backend.RayBackend``
(actors on a Ray cluster) and ``cluster.local.LocalBackend`` (one process, plain torch) - and
the loops name neither.

Data moves by reference. ``fetch`` gives the loop ``Held`` rollouts - a summary (group,
version, reward, length) and a handle of the chunk the rollout is in - never the tokens; the
loop decides which rollouts a step trains on (a ``primitives.types.BatchPlan``) and the
backend's trainer ranks build the batch from the chunks themselves.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence

from primitives.types import BatchPlan, GenerationConfig, RolloutSummary, TrainState

# the roles a backend of actors rebuilds when one of their actors dies or stops answering
RECOVERABLE_ROLES = ("generator", "reward", "reference", "trainer", "critic")


class ActorFailure(RuntimeError):
    """An actor died, raised, or did not answer in time (``stuck``); the message names role and rank."""

    def __init__(self, message: str, role: str = "", rank: int = -1, died: bool = False, stuck: bool = False,
                 actor_id: str = "", late: tuple = (), final: bool = False):
        super().__init__(message)
        self.role, self.rank, self.died, self.stuck = role, rank, died, stuck
        self.final = final  # recovery gave up (restarts spent, nothing to restore from): never retried
        self.actor_id = actor_id  # the dead actor, where the backend knows it (it may be one the call read from)
        # (role, rank) of every actor that did not answer in time: in a collective, the stuck one and its waiting peers
        self.late = late or ((role, rank),)

    @property
    def replaceable(self) -> bool:
        """A dead or stuck actor of any role is replaced (a stuck one killed first) and its work
        done again; a raising user function (a bug) is not."""
        return (self.died or self.stuck) and self.role in RECOVERABLE_ROLES and not self.final


class Held(NamedTuple):
    """A rollout the backend holds: its summary, and where it is (rollout ``index`` of the
    chunk ``part``, a handle only the backend reads)."""

    summary: RolloutSummary
    part: Any
    # the row in its chunk (the field shadows tuple.index, which nothing here calls)
    index: int  # type: ignore[assignment]

    @property
    def group(self) -> str:
        return self.summary.group

    @property
    def policy_version(self) -> int:
        return self.summary.policy_version


class StepResult(NamedTuple):
    """What a train step reports: each trainer rank's updates (and each critic rank's), and the
    trained batch's statistics (``primitives.maths.batching.rollout_metrics``); ``batch_metrics``
    is None when the plan had nothing to train (a pairwise loss that found no pair)."""

    policy: list  # per rank: [update metrics, ...]
    critic: Optional[list]
    batch_metrics: Optional[dict]


def plan_parts(rows: Sequence[Held]) -> tuple:
    """``(rows as (part, index), parts)``: the distinct chunks the rows are in, in first-seen
    order, and each row's position in them (a ``BatchPlan``'s ``rows``)."""
    parts: list = []
    where: dict = {}
    out: list = []
    for h in rows:
        key = id(h.part)
        if key not in where:
            where[key] = len(parts)
            parts.append(h.part)
        out.append((where[key], h.index))
    return tuple(out), parts


class Backend(Protocol):
    """The operations of an RL or SFT run. ``pending`` values are the backend's own handles of
    work in flight (``generate`` -> ``reference_logprobs`` / ``score`` -> ``fetch``)."""

    # read by the loop, set by the backend (a plain attribute or a property)
    @property
    def name(self) -> str: ...  # for messages ("ray", "local")
    @property
    def pad_token_id(self) -> int: ...
    @property
    def restarts(self) -> int: ...  # actors replaced so far
    @property
    def has_reference(self) -> bool: ...
    @property
    def has_critic(self) -> bool: ...
    @property
    def reference_in_train_step(self) -> bool: ...  # the trainer ranks score their own shards' reference logprobs
    @property
    def reward_needs_reference(self) -> bool: ...  # the shaping function reads ref_logprobs (KL in the reward)
    @property
    def remote(self) -> bool: ...  # functions travel to other processes (they must pickle)

    def generate(self, items: Sequence, gen: GenerationConfig, tools=None) -> Any: ...
    def reference_logprobs(self, pending: Any, temperature: float) -> Any: ...
    def score(self, pending: Any, shaped: bool = True) -> Any: ...  # shaped False: the task reward (evaluation)
    def score_and_reference(self, pending: Any, temperature: float) -> Any: ...
    def fetch(self, pending: Any) -> tuple: ...  # (list[Held], {"time/<phase>": seconds})
    def select(self, rows: Sequence[Held], filters: Sequence) -> list: ...  # the Held rows the filters keep
    def rollouts(self, rows: Sequence[Held]) -> list: ...  # the full rollouts (evaluation writes them out)
    def values(self, plan: BatchPlan, parts: list) -> Any: ...  # the critic's values of the plan's rows
    def train_step(self, plan: BatchPlan, parts: list, values: Any, algo, temperature: float,
                   lr: Optional[float], with_critic: bool) -> StepResult: ...
    def sync(self, version: int, step: int, kl: Optional[float]) -> dict: ...
    def sft_step(self, arrays: tuple, lr: Optional[float]) -> list: ...  # per rank metrics
    def sft_eval(self, arrays: tuple) -> list: ...  # per rank metrics
    def save(self, path: str, state: TrainState) -> str: ...
    def load(self, path: str) -> TrainState: ...
    def busy(self) -> dict: ...
    # vllm/prompt_tokens and vllm/prefix_cache_share since the last call ({} where no generator runs vLLM)
    def prefix_cache(self) -> dict: ...
    # the role it recovered (None: nothing to do); ``lost``: seconds of work the failure cost
    def recover(self, failure: ActorFailure, since: int, send_weights: bool = True,
                lost: float = 0.0) -> Optional[str]: ...
    def settle(self, pending: Sequence) -> None: ...
    def prepare_recovery(self) -> None: ...  # keep what a recovery restores from (before the first step)
    def fault_metrics(self) -> dict: ...  # faults/* so far (restarts by role, seconds lost); {} without any
    # generator workers that grow and shrink while the run goes on (``RLRun.generator_policy``): only where
    # ``can_scale_generators`` (the Ray backend's own workers, not generation on the trainer ranks)
    @property
    def can_scale_generators(self) -> bool: ...
    @property
    def generator_count(self) -> int: ...
    def scale_generators(self, n: int, in_flight: Sequence = ()) -> dict: ...
