"""The RL loop (architecture section 4): ``train`` over any backend of ``cluster.loop.protocol``.

Orchestration only: no maths, no model code, no Ray. Each step draws prompts, has the backend
generate, score and (when the algorithm needs them) add reference logprobs, keeps what the
algorithm's filters keep, and hands the trainer ranks a ``BatchPlan``: which rollouts, by
reference. The loop itself holds only the rollouts' summaries. Each phase is timed
(``time/generate``, ``time/ref``, ``time/reward``, ``time/train``, ``time/sync``).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple, Optional, Sequence

from tqdm import tqdm

from cluster.loop.checks import check_algorithm_for, check_train_run, seen_before
from cluster.loop.protocol import ActorFailure, Backend, plan_parts
from primitives.hooks import call_hook
from primitives.io.loggers import noop_logger
from primitives.maths.algorithms import needs_values, uses_reference
from primitives.maths.filters import by_group
from primitives.maths.metrics import (
    merge_metrics,
    merge_rank_updates,
    stale_groups,
    staleness_metrics,
    tool_metrics,
)
from primitives.types import BatchPlan, GenerationConfig, RolloutBatch, TrainState, group_id


class Collection(NamedTuple):
    """Prompts drawn for a step whose rollouts are in flight on the backend (not trained yet)."""

    items: list  # the prompt items
    position: object  # the prompt source's position after them
    handle: object  # the backend's handle of the rollouts (generate -> reference, reward)
    restarts: int  # backend.restarts when dispatched (an actor replaced later failed it)
    with_ref: bool  # reference logprobs were asked for
    shaped: bool = True  # rewards through the shaping function (False: the task's reward, for an evaluation)


def collects_reference(backend: Backend, algo) -> bool:
    """Whether the step's rollouts are collected with reference logprobs. A reference on the
    trainer ranks scores each rank's shard inside the train step instead, unless they are
    needed before the batch is made: KL in the reward (the advantage or the shaping function
    reads them)."""
    if not backend.has_reference:
        return False
    if backend.reference_in_train_step:
        return bool(algo.kl_in_reward and algo.kl_coef) or backend.reward_needs_reference
    return uses_reference(algo) or backend.reward_needs_reference


def dispatch(backend: Backend, items: Sequence, position, gen: GenerationConfig, with_ref: bool,
             tools=None, shaped: bool = True) -> Collection:
    """Start generating ``items`` (then rewards and, with ``with_ref``, reference logprobs) on
    the backend without waiting. Reference logprobs and rewards run side by side unless the
    shaping function reads reference logprobs (KL in the reward); then the reference comes
    first. Logprobs are scored at the sampling temperature. ``shaped`` False (an evaluation, no
    reference): the task's reward, the shaping function left out."""
    handle = backend.generate(items, gen, tools)
    if with_ref and backend.reward_needs_reference:
        handle = backend.score(backend.reference_logprobs(handle, gen.temperature))
    elif with_ref:
        handle = backend.score_and_reference(handle, gen.temperature)
    else:
        handle = backend.score(handle) if shaped else backend.score(handle, shaped=False)
    return Collection(list(items), position, handle, backend.restarts, with_ref, shaped)


def fetch_collection(backend: Backend, coll: Collection, gen: GenerationConfig, tools=None) -> tuple:
    """``(rollouts, times)`` of a dispatched collection. If an actor it ran on died, the actor
    is replaced (unless that happened since the dispatch) and the same prompts are generated
    again by the current policy, so nothing is lost and nothing is used twice."""
    while True:
        try:
            return backend.fetch(coll.handle)
        except ActorFailure as failure:
            backend.recover(failure, since=coll.restarts)
            coll = dispatch(backend, coll.items, coll.position, gen, coll.with_ref, tools, coll.shaped)


def collect(backend: Backend, items: Sequence, gen: GenerationConfig, with_ref: bool, tools=None,
            shaped: bool = True) -> tuple:
    """``(rollouts, times)``: generate, then rewards (``shaped``: through the shaping function) and
    reference logprobs, waited for, and the rollouts fetched whole (to look at them or write them
    out; the RL loop keeps only their summaries)."""
    held, times = fetch_collection(backend, dispatch(backend, items, None, gen, with_ref, tools, shaped), gen, tools)
    return backend.rollouts(held), times


SELECT_ATTEMPTS = 8  # tries of the filters on the same rows (each after a recovery) before the failure is raised


def select(backend: Backend, rows: Sequence, filters: Sequence) -> list:
    """The rows ``filters`` keep (``backend.select``). The rollouts stay where they were scored,
    so a replaceable actor that dies while the filters run is replaced and the filters run
    again on the same rows: nothing is generated twice."""
    for _ in range(SELECT_ATTEMPTS):
        try:
            return backend.select(rows, filters)
        except ActorFailure as failure:
            backend.recover(failure, since=backend.restarts)
    return backend.select(rows, filters)  # the last try: a failure now is raised (nothing left a replacement mends)


def fresh_rollouts(backend: Backend, coll: Collection, gen: GenerationConfig, version: int, max_staleness: int,
                   with_ref: bool, tools=None, max_attempts: int = 3) -> tuple:
    """``(rollouts, times, regenerated)`` of a collection, each within ``max_staleness`` of
    ``version`` and with reference logprobs when ``with_ref``: the prompts of groups older
    than the bound (or lacking reference logprobs the algorithm now needs) are generated
    again, in their places, never trained on stale; ``regenerated`` counts the rollouts
    replaced."""
    rollouts, times = fetch_collection(backend, coll, gen, tools)
    regenerated = 0
    for attempt in range(max_attempts + 1):
        redo = stale_groups(rollouts, version, max_staleness)
        if with_ref and any(not r.summary.has_ref for r in rollouts):
            redo |= {r.group for r in rollouts if not r.summary.has_ref}
        if not redo:
            return rollouts, times, regenerated
        if attempt == max_attempts:
            break
        items = [it for it in coll.items if group_id(it.epoch, it.index) in redo]
        again, t = fetch_collection(backend, dispatch(backend, items, coll.position, gen, with_ref, tools), gen, tools)
        times, regenerated = merge_metrics([times, t]), regenerated + sum(r.group in redo for r in rollouts)
        # each regenerated group in the place of the stale one (groups stay contiguous)
        fresh = by_group(again)
        rollouts = [r for group, old in by_group(rollouts).items() for r in (fresh.get(group, []) if group in redo
                                                                             else old)]
    raise RuntimeError(f"rollouts of {sorted(redo)[:3]}... are still more than {max_staleness} policy versions "
                       f"behind {version} after {max_attempts} regenerations: a generator is not receiving weights")


def collect_rollouts(backend: Backend, prompt_source: Callable, state: TrainState, algo, gen: GenerationConfig,
                     prompts_per_step: int, max_rounds: int, tools=None, queue: Optional[deque] = None,
                     max_staleness: int = 0):
    """One step's rollouts, from the collections in flight (``queue``, oldest first; drawn and
    dispatched now when it is empty). When the algorithm's filters drop groups (DAPO's
    dynamic sampling drops groups whose rewards are all equal), the next collection in flight
    is taken, or more prompts are drawn, up to ``max_rounds`` extra rounds, until the step has
    ``prompts_per_step`` groups; when every round's groups were dropped, the step has no
    rollouts (``train`` skips its update). Prompts are consumed in the order drawn, so the data
    position after the step says exactly what was trained (or dropped)."""
    queue = deque() if queue is None else queue
    with_ref, version = collects_reference(backend, algo), state.policy_version
    position, rounds, drawn, regenerated = state.data_position, 0, 0, 0
    kept: list = []
    times: dict = {}
    while True:
        if not queue:
            want = prompts_per_step - len({r.group for r in kept}) if algo.filters else prompts_per_step
            items, after = call_hook(prompt_source, "prompt_source", position, want)
            queue.append(dispatch(backend, items, after, gen, with_ref, tools))
        coll = queue.popleft()
        rollouts, t, redone = fresh_rollouts(backend, coll, gen, version, max_staleness, with_ref, tools)
        position, drawn, regenerated = coll.position, drawn + len(coll.items), regenerated + redone
        times = merge_metrics([times, t])
        kept += select(backend, rollouts, algo.filters) if algo.filters else rollouts
        if not algo.filters or len({r.group for r in kept}) >= prompts_per_step or rounds >= max_rounds:
            break
        rounds += 1
    extra = {"data/prompts_drawn": float(drawn), "data/resample_rounds": float(rounds),
             "staleness/regenerated": float(regenerated), **staleness_metrics(kept, version)}
    return kept, position, {**times, **extra}


# what a step with nothing to train logs in place of its update (no rows, no optimizer step)
SKIPPED_UPDATE = {"batch/rows": 0.0, "batch/loss_tokens": 0.0, "policy/updates": 0.0}


def train_and_sync(backend: Backend, rows: Sequence, plan_args: dict, algo, temperature: float, lr: Optional[float],
                   version: int, step: int, queue: deque) -> Optional[dict]:
    """One update on the step's ``rows`` (``Held``; the policy's, and the critic's when the
    algorithm reads values), then the weights sent to the generators as ``version``; the
    metrics of both and of the trained batch. None when the batch had nothing to train (a
    pairwise loss found no pair): no update happened and nothing is sent."""
    t0 = time.perf_counter()
    with_critic = needs_values(algo)
    positions, parts = plan_parts(rows)
    plan = BatchPlan(positions, backend.pad_token_id, **plan_args)
    values = backend.values(plan, parts) if with_critic else None
    result = backend.train_step(plan, parts, values, algo, temperature, lr, with_critic)
    if result.batch_metrics is None:
        return None
    metrics = {"time/train": time.perf_counter() - t0}
    trained, _ = merge_rank_updates(result.policy)
    if result.critic is not None:
        critic, _ = merge_rank_updates(result.critic)
        trained.update({k: v for k, v in critic.items() if k.startswith("critic/")})
    if queue:  # a generator that died under the collections in flight is replaced before the sync
        backend.settle(list(queue))
    metrics.update(backend.sync(version, step, trained.get("kl/ref_k3")))
    return {**metrics, **trained, **result.batch_metrics}


def scale_for_step(backend: Backend, policy: Optional[Callable], history: Sequence, queue: deque) -> dict:
    """Grow or shrink the backend's generator workers to what ``policy`` asks for the coming
    step (the collections in flight finish first: none is lost); ``generators/count`` and, when
    it changed, ``time/scale``. {} without a policy. The policy sees the count the run last logged: a
    run resumed from a checkpoint starts at the job's ``cluster.generators``, and goes on at the size
    it had (an ``idle`` policy keeps its count between decisions; it kept the started one)."""
    if policy is None:
        return {}
    current = backend.generator_count
    logged = next((m["generators/count"] for m in reversed(history) if "generators/count" in m), None)
    wanted = call_hook(policy, "generator_policy", history, current if logged is None else int(logged))
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise ValueError(f"generator_policy returned {wanted!r}; expected a count (int) >= 1")
    if wanted == current:
        return {"generators/count": float(current)}
    return backend.scale_generators(wanted, list(queue))


class RLRun(NamedTuple):
    """How an RL run samples and how long it trains (``train``'s settings)."""

    gen: GenerationConfig  # sampling: n completions per prompt, the temperature the logprobs are of
    num_steps: int  # RL iterations in all (a resumed run counts on from its state)
    prompts_per_step: int
    lr_schedule: Callable[[int], Optional[float]]  # iteration -> learning rate (None: the optimizer's own)
    max_resample_rounds: int = 4  # dynamic sampling: extra generation rounds per step
    max_staleness: int = 0  # asynchronous RL: generate up to this many steps ahead (0: synchronous)
    component_names: Optional[tuple] = None  # reward component names (``build_reward``'s labels)
    progress: bool = True  # a tqdm bar
    # (history, current count) -> generator workers for the next step (primitives.maths.scaling); None: fixed
    generator_policy: Optional[Callable] = None


class Hooks(NamedTuple):
    """What ``train`` calls besides the backend: ``logger(metrics)`` after every step,
    ``eval_fn(backend, state) -> dict`` and ``checkpoint_fn(backend, state)`` every
    ``eval_every`` / ``checkpoint_every`` steps (evaluation also at the last);
    ``checkpoint_fn`` also after the first step that ends ``checkpoint_minutes`` or more
    after the loop started or after the last checkpoint (``time.perf_counter``; 0: off),
    so a long run keeps a recent checkpoint whatever its step time; and
    ``iteration_hook(state, batch)`` after every step's logger: ``state`` is the ``TrainState``
    after the step (its ``metrics_history[-1]`` the step's metrics), ``batch`` a
    ``primitives.types.RolloutBatch`` of the rollouts the step kept for its update (after the
    filters; empty when the filters kept none), fetched whole from the backend only when this
    hook is set (on Ray they travel to the driver for it). ``ledger(step, groups)`` after
    every step gets the ids of the prompt groups the step trained (``group_id``: epoch and
    index), in order: an audit that every prompt is trained once per epoch, whatever died."""

    logger: Callable = noop_logger
    eval_fn: Optional[Callable] = None
    eval_every: int = 0
    checkpoint_fn: Optional[Callable] = None
    checkpoint_every: int = 0
    checkpoint_minutes: float = 0.0
    iteration_hook: Optional[Callable] = None
    ledger: Optional[Callable] = None


def checkpoint_due(steps_done: int, every: int, minutes: float, since: float) -> bool:
    """Whether a checkpoint is due after ``steps_done`` steps: every ``every`` steps, or once
    ``minutes`` have passed since ``since`` (a ``time.perf_counter()`` reading: the loop's
    start or the last checkpoint). 0 turns a rule off."""
    return bool(every and steps_done % every == 0) or bool(minutes and time.perf_counter() - since >= 60 * minutes)


def train(backend: Backend, prompt_source: Callable, algorithm_schedule: Callable, run: RLRun,
          state: TrainState = TrainState(), hooks: Hooks = Hooks(), tools=None) -> TrainState:
    """The RL loop: prompts -> rollouts (generate, reference, reward) -> (values) -> batch ->
    train -> sync, on ``backend`` (any backend of ``cluster.loop.protocol``),
    with the settings of ``run`` (``RLRun``) and the ``hooks`` (``Hooks``).

    * ``prompt_source(position, n) -> (items, position)`` draws the prompts.
    * ``algorithm_schedule(iteration, last_metrics) -> AlgorithmConfig`` is evaluated every
      step (``last_metrics``: the previous step's logged metrics, {} at the first), so
      switching algorithm or KL coefficient mid-run - at an iteration or on a metric - is a
      function. An algorithm whose advantage reads values trains the critic too.
    * ``tools`` (a ``primitives.env.tools.ToolConfig``) makes rollouts multi-turn tool use.
    * ``eval_fn(backend, state) -> dict`` and ``checkpoint_fn(backend, state)`` run every
      ``eval_every`` / ``checkpoint_every`` steps (``checkpoint_fn`` also every
      ``checkpoint_minutes``); ``logger(metrics)`` after every step.
    * On a backend of actors, a generator or reward worker that dies is replaced and the step's prompts are
      collected again, so no prompt is lost or trained twice.
    * ``component_names`` (``build_reward``'s labels) name the logged ``reward/<name>``.
    * A step with nothing to train - the filters kept no group, or a pairwise loss found no
      pair (every group's rewards tied) - skips its update: the weights, the optimizer and the
      policy version stay, its prompts count as consumed, and it logs ``policy/updates`` 0
      and ``batch/rows`` 0 (no ``reward/*``: those describe the trained batch).
    * ``max_staleness`` > 0 is asynchronous RL: the prompts of the next ``max_staleness``
      steps are generated (and scored) while this step trains, so a rollout is trained by a
      policy up to that many versions newer than its generator's. Rollouts are consumed oldest
      first; one older than the bound is generated again, never trained on. The generator's
      logprobs enter the loss through the capped importance weight (``algo.is_cap``). 0 is
      the synchronous loop. Logged: ``staleness/*``, ``mismatch/*``, ``idle/generators``
      and ``idle/trainers`` (the share of the step each role sat idle).
    * ``generator_policy(history, current) -> count`` (``primitives.maths.scaling``) sizes the
      backend's generator workers before every step: a change drains the generation in flight,
      then grows or shrinks them (``backend.scale_generators``); logged ``generators/count``.

    Returns the final ``TrainState`` (its ``metrics_history`` holds every step's metrics).
    A backend that replaces actors holds the new ones (the Ray backend's ``cluster`` changes).
    """
    checked = check_train_run(backend, prompt_source, algorithm_schedule, run, hooks, tools)
    queue: deque = deque()  # collections in flight for the coming steps (asynchronous mode), oldest first
    backend.prepare_recovery()  # a backend that survives actor deaths keeps their state from here
    backend.busy(), backend.prefix_cache()  # start the idle clocks and the prompt token counts
    t_clock = last_saved = time.perf_counter()
    bar = tqdm(range(state.iteration, run.num_steps), desc="rl", unit="step",
               **({} if run.progress else {"disable": True}))
    for it in bar:
        t_step = time.perf_counter()
        algo = step_algorithm(backend, algorithm_schedule, state, it, checked, run.gen.n)
        scaled = scale_for_step(backend, run.generator_policy, state.metrics_history, queue)
        rollouts, position, metrics = collect_rollouts(backend, prompt_source, state, algo, run.gen,
                                                       run.prompts_per_step, run.max_resample_rounds, tools, queue,
                                                       run.max_staleness)
        dispatch_ahead(backend, prompt_source, queue, position, algo, run, it, tools)
        metrics.update({"recovery/actor_restarts": float(backend.restarts), **scaled})
        trained = update_and_sync(backend, rollouts, state, algo, run, it, queue, tools)
        updated = trained is not None
        idle, t_clock = idle_shares(backend, t_clock)
        metrics.update({**idle, **backend.prefix_cache(), **(trained or SKIPPED_UPDATE), "step": it,
                        "algorithm": algo.name, "time/step": time.perf_counter() - t_step,
                        **backend.fault_metrics()})
        if tools is not None:
            metrics.update(tool_metrics([r.summary for r in rollouts]))
        state = state._replace(iteration=it + 1, global_step=state.global_step + int(updated),
                               policy_version=state.policy_version + int(updated), data_position=position)
        state, saved, evaluated = after_step(backend, state, metrics, rollouts, updated, run, hooks, last_saved)
        if "reward/mean" in metrics:  # a skipped step has no trained batch to describe
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if saved:
            last_saved = time.perf_counter()
        if evaluated or saved:  # neither counts in the next step's idle shares (nor an evaluation's prompts)
            backend.busy(), backend.prefix_cache()
            t_clock = time.perf_counter()
    return state


def step_algorithm(backend: Backend, algorithm_schedule: Callable, state: TrainState, it: int, checked: set,
                   group_size: int):
    """The schedule's algorithm for step ``it`` (from the last step's metrics), checked against the
    backend and the run's ``group_size`` the first time it appears."""
    last = state.metrics_history[-1] if state.metrics_history else {}
    algo = call_hook(algorithm_schedule, "algorithm_schedule", it, last)
    if not seen_before(algo, checked):
        check_algorithm_for(backend, algo, group_size)
    return algo


def dispatch_ahead(backend: Backend, prompt_source: Callable, queue: deque, position, algo, run: RLRun, it: int,
                   tools) -> None:
    """Asynchronous mode: the next ``run.max_staleness`` steps' prompts, generated while this step trains. With
    filters (dynamic sampling) a step may need more prompts than one collection: those steps draw what they
    need when they need it, so a step never takes a second collection."""
    ahead = 0 if algo.filters else min(run.max_staleness, run.num_steps - it - 1)
    while len(queue) < ahead:
        items, after = call_hook(prompt_source, "prompt_source", queue[-1].position if queue else position,
                                 run.prompts_per_step)
        queue.append(dispatch(backend, items, after, run.gen, collects_reference(backend, algo), tools))


def policy_token_budget(gen: GenerationConfig, tools=None) -> int:
    """The most policy tokens a rollout can hold: ``gen.max_new_tokens`` a turn, over ``tools.max_turns``
    turns with tools. ``make_batch``'s ``budget``: DAPO's overlong limit (a per-turn budget there took
    the reward from rollouts of 2 turns of 12 tokens under 20 a turn) and Dr.GRPO's constant normaliser."""
    return gen.max_new_tokens * (max(1, tools.max_turns) if tools is not None else 1)


def update_and_sync(backend: Backend, rollouts: Sequence, state: TrainState, algo, run: RLRun, it: int,
                    queue: deque, tools=None) -> Optional[dict]:
    """The step's update and weight sync (``train_and_sync``) as the next policy version; None when there
    is nothing to train (no rollouts kept, or no pair found): no update, no sync, the weights stay."""
    if not rollouts:
        return None
    plan_args = {"seed": state.rng_seed + it, "budget": policy_token_budget(run.gen, tools),
                 "component_names": None if run.component_names is None else tuple(run.component_names)}
    return train_and_sync(backend, rollouts, plan_args, algo, run.gen.temperature, run.lr_schedule(it),
                          state.policy_version + 1, it + 1, queue)


def idle_shares(backend: Backend, since: float) -> tuple:
    """``({"idle/<role>": share of the time since ``since`` the role sat idle}, now)``."""
    busy, now = backend.busy(), time.perf_counter()
    return {f"idle/{role}": max(0.0, 1.0 - seconds / (now - since)) for role, seconds in busy.items()}, now


def after_step(backend: Backend, state: TrainState, metrics: dict, rollouts: Sequence, updated: bool, run: RLRun,
               hooks: Hooks, last_saved: float) -> tuple:
    """A finished step's hooks, in order: evaluation when due (its metrics join the step's), the metrics
    history and the logger, the ledger of trained groups, the iteration hook, a checkpoint when due.
    Returns ``(state, saved, evaluated)``."""
    it, eval_fn, checkpoint_fn = state.iteration - 1, hooks.eval_fn, hooks.checkpoint_fn
    evaluated = bool(hooks.eval_every) and ((it + 1) % hooks.eval_every == 0 or it + 1 == run.num_steps)
    if eval_fn is not None and evaluated:
        metrics.update(call_hook(eval_fn, "eval_fn", backend, state))
    state = state._replace(metrics_history=state.metrics_history + (metrics,))
    call_hook(hooks.logger, "logger", metrics)
    if hooks.ledger is not None:
        call_hook(hooks.ledger, "ledger", it, list(dict.fromkeys(r.group for r in rollouts)) if updated else [])
    if hooks.iteration_hook is not None:
        trained_rollouts = tuple(backend.rollouts(rollouts)) if rollouts else ()
        call_hook(hooks.iteration_hook, "iteration_hook", state, RolloutBatch(trained_rollouts))
    saved = checkpoint_fn is not None and checkpoint_due(it + 1, hooks.checkpoint_every, hooks.checkpoint_minutes,
                                                         last_saved)
    if checkpoint_fn is not None and saved:
        call_hook(checkpoint_fn, "checkpoint_fn", backend, state)
    return state, saved, eval_fn is not None and evaluated
