"""The driver functions: ``train`` (the RL loop of DESIGN section 4) and ``train_sft``.

Orchestration only: no maths, no model code. Rollouts move between actors as ObjectRefs;
every wait is here, bounded, and a dead or failing actor surfaces as an error naming its
role and rank. Each phase is timed (``time/generate``, ``time/reward``, ``time/ref``,
``time/train``, ``time/sync``).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from cluster.groups import ActorFailure, call, fan_out, fan_out_each, gather, split_evenly
from cluster.setup import RLCluster, replace_actor
from primitives.algorithms import AlgorithmConfig, uses_reference
from primitives.batching import make_batch, rollout_metrics
from primitives.checkpoint import state_from_json, state_to_json
from primitives.data import SFTSample, collate_sft
from primitives.evaluation import eval_metrics, sample_records, write_jsonl_atomic
from primitives.filters import apply_filters
from primitives.loggers import noop_logger
from primitives.metrics import merge_metrics, merge_rank_updates
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


def generate_and_score(cluster: RLCluster, items: Sequence, gen: GenerationConfig, with_ref: bool,
                       generate_method: str = "generate", extra_args: tuple = ()):
    """Generators -> reference -> reward workers, chained by ref; returns (rollouts, timings).

    Reference logprobs come before rewards so that a shaping function may use them (KL in
    the reward); they are scored at the sampling temperature ``gen.temperature``.
    ``generate_method="generate_multiturn"`` with ``extra_args=(tool_parser, tool_executor,
    max_turns)`` runs tool-using rollouts instead."""
    t0 = time.perf_counter()
    chunks = split_evenly(list(items), cluster.generators.size)
    gen_calls = fan_out_each(cluster.generators, generate_method,
                             [(c, gen, *extra_args) if c else None for c in chunks])
    ref_calls = [call(cluster.reference, 0, "logprobs", c.ref, gen.temperature) for c in gen_calls] if with_ref else []
    score_calls = [call(cluster.rewards, i % cluster.rewards.size, "score", c.ref)
                   for i, c in enumerate(ref_calls or gen_calls)]
    gather(gen_calls, cluster.timeout_s)
    t1 = time.perf_counter()
    gather(ref_calls, cluster.timeout_s)
    t2 = time.perf_counter()
    scored = gather(score_calls, cluster.timeout_s)
    t3 = time.perf_counter()
    times = {"time/generate": t1 - t0, "time/ref": t2 - t1, "time/reward": t3 - t2}
    return _flat(scored), times


def collect_rollouts(cluster: RLCluster, prompt_source: Callable, state: TrainState, algo: AlgorithmConfig,
                     gen: GenerationConfig, prompts_per_step: int, max_rounds: int):
    """One step's rollouts. With DAPO dynamic sampling, groups whose rewards are all equal are
    dropped and more prompts are drawn (up to ``max_rounds`` extra rounds) until the step has
    ``prompts_per_step`` informative groups."""
    with_ref = cluster.reference is not None and (uses_reference(algo) or cluster.reward_needs_reference)
    position, kept, times, rounds, drawn = state.data_position, [], {}, 0, 0
    while True:
        want = prompts_per_step - len({r.group for r in kept}) if algo.filters else prompts_per_step
        items, position = prompt_source(position, want)
        drawn += len(items)
        rollouts, t = generate_and_score(cluster, items, gen, with_ref)
        times = merge_metrics([times, t])
        kept += apply_filters(rollouts, algo.filters)
        if not algo.filters or len({r.group for r in kept}) >= prompts_per_step or rounds >= max_rounds:
            break
        rounds += 1
    if not kept:
        raise RuntimeError(f"step {state.iteration}: the filters of '{algo.name}' kept no group after {rounds + 1} "
                           "rounds (with dynamic sampling: every group had equal rewards)")
    extra = {"data/prompts_drawn": float(drawn), "data/resample_rounds": float(rounds)}
    return kept, position, {**times, **extra}


def with_replacement(cluster: RLCluster, work: Callable[[RLCluster], tuple], version: int, restarts: int,
                     max_restarts: int):
    """``work(cluster)``; if a generator or reward worker died, replace it (a new generator
    first receives the weights of ``version``) and run ``work`` again with the same inputs.
    Returns ``(result, cluster, restarts)``."""
    while True:
        try:
            return work(cluster), cluster, restarts
        except ActorFailure as failure:
            if not failure.replaceable or restarts >= max_restarts:
                raise
            restarts += 1
            tqdm.write(f"{failure}; replacing it and running the step's collection again")
            cluster = replace_actor(cluster, failure.role, failure.rank)
            if failure.role == "generator":
                sync_weights(cluster, version)


def train(cluster: RLCluster, prompt_source: Callable, algorithm_schedule: Callable[[int], AlgorithmConfig],
          gen: GenerationConfig, num_steps: int, prompts_per_step: int, lr_schedule: Callable[[int], float],
          state: TrainState = TrainState(), logger: Callable = noop_logger, eval_fn: Optional[Callable] = None,
          eval_every: int = 0, checkpoint_fn: Optional[Callable] = None, checkpoint_every: int = 0,
          max_resample_rounds: int = 4, max_actor_restarts: int = 3, progress: bool = True,
          component_names: Optional[Sequence[str]] = None):
    """The RL loop: prompts -> rollouts (generate, reward, reference) -> batch -> train -> sync.

    ``algorithm_schedule(iteration)`` is evaluated every step, so switching algorithm or KL
    coefficient mid-run is a function. ``eval_fn(cluster, state) -> dict`` and
    ``checkpoint_fn(cluster, state)`` run every ``eval_every`` / ``checkpoint_every`` steps.
    A generator or reward worker that dies is replaced (up to ``max_actor_restarts`` times)
    and the step's prompts are collected again, so no prompt is lost or trained twice.
    ``component_names`` (``build_reward``'s labels) name the logged ``reward/<name>`` of a
    vector reward.
    Returns ``(state, cluster)``: the cluster record changes when an actor was replaced.
    """
    import ray

    if gen.temperature <= 0:
        raise ValueError(f"RL sampling needs temperature > 0, got {gen.temperature}: logprobs are of "
                         "softmax(logits / T), and T = 0 (greedy) samples nothing to learn from")
    bar = tqdm(range(state.iteration, num_steps), desc="rl", unit="step", **({} if progress else {"disable": True}))
    restarts = 0
    for it in bar:
        t_step = time.perf_counter()
        algo = algorithm_schedule(it, state.metrics_history[-1] if state.metrics_history else {})
        collect = functools.partial(collect_rollouts, prompt_source=prompt_source, state=state, algo=algo, gen=gen,
                                    prompts_per_step=prompts_per_step, max_rounds=max_resample_rounds)
        (rollouts, position, metrics), cluster, restarts = with_replacement(
            cluster, collect, state.policy_version, restarts, max_actor_restarts)
        metrics["recovery/actor_restarts"] = float(restarts)
        batch = make_batch(rollouts, algo, cluster.pad_token_id, seed=state.rng_seed + it, budget=gen.max_new_tokens)
        t0 = time.perf_counter()
        batch_ref = ray.put(batch)
        per_rank = gather(fan_out(cluster.trainers, "train_step", batch_ref, algo, gen.temperature, lr_schedule(it)),
                          cluster.timeout_s)
        metrics["time/train"] = time.perf_counter() - t0
        trained, _ = merge_rank_updates(per_rank)
        version = state.policy_version + 1
        metrics.update(sync_weights(cluster, version, it + 1, trained.get("kl/ref_k3")))
        metrics.update({**trained, **rollout_metrics(batch, component_names), "step": it, "algorithm": algo.name,
                        "time/step": time.perf_counter() - t_step})
        state = state._replace(iteration=it + 1, global_step=state.global_step + 1, policy_version=version,
                               data_position=position)
        if eval_fn is not None and eval_every and ((it + 1) % eval_every == 0 or it + 1 == num_steps):
            metrics.update(eval_fn(cluster, state))
        state = state._replace(metrics_history=state.metrics_history + (metrics,))
        logger(metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if checkpoint_fn is not None and checkpoint_every and (it + 1) % checkpoint_every == 0:
            checkpoint_fn(cluster, state)
    return state, cluster


def train_sft(cluster: RLCluster, samples: Sequence[SFTSample], num_steps: int, batch_size: int,
              lr_schedule: Callable[[int], float], seed: int = 0, logger: Callable = noop_logger,
              log_every: int = 1, progress: bool = True, eval_samples: Sequence[SFTSample] = (),
              eval_every: int = 0, checkpoint_fn: Optional[Callable] = None, checkpoint_every: int = 0,
              start_step: int = 0) -> dict:
    """Supervised fine-tuning on the trainer group (the weights stay there: ``sync_weights``
    sends them on).

    Each step draws ``batch_size`` samples (seeded, without replacement within the step);
    every trainer rank takes its share and the loss is normalised by the step's global
    target-token count. With ``eval_samples``, the held-out loss (``eval/loss_sft``) is
    logged every ``eval_every`` steps and at the end; ``checkpoint_fn(cluster, step)`` runs
    every ``checkpoint_every`` steps. ``start_step`` continues a run from a checkpoint: the
    draws of the steps before it are replayed, so the run goes on as if never stopped.
    Returns the last step's metrics.
    """
    import ray

    if not samples:
        raise ValueError("train_sft: no samples")
    rng = np.random.default_rng(seed)
    pad = cluster.pad_token_id
    size = min(batch_size, len(samples))
    for _ in range(start_step):
        rng.choice(len(samples), size, replace=False)
    metrics: dict = {}
    bar = tqdm(range(start_step, num_steps), desc="sft", unit="step", **({} if progress else {"disable": True}))
    for step in bar:
        picked = rng.choice(len(samples), size, replace=False)
        ids, attn, loss_mask = collate_sft([samples[i] for i in picked], pad)
        refs = [ray.put(ids), ray.put(attn), ray.put(loss_mask)]
        stats = gather(fan_out(cluster.trainers, "sft_step", *refs, lr_schedule(step)), cluster.timeout_s)
        metrics = {**merge_metrics(stats), "step": step, "phase": "sft"}
        last = step + 1 == num_steps
        evaluated = bool(eval_samples) and eval_every > 0 and ((step + 1) % eval_every == 0 or last)
        if evaluated:
            metrics.update(evaluate_sft(cluster, eval_samples))
            bar.set_postfix(eval_loss=f"{metrics['eval/loss_sft']:.4f}")
        if step % log_every == 0 or last or evaluated:
            logger(metrics)
        if checkpoint_fn is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
            checkpoint_fn(cluster, step + 1)
    return metrics


def evaluate_sft(cluster: RLCluster, samples: Sequence[SFTSample], chunk: int = 256) -> dict:
    """Held-out SFT loss: the mean NLL per target token over ``samples`` (no update), computed
    on the trainer ranks ``chunk`` samples at a time; ``eval/sft_tokens`` is the token count."""
    import ray

    if not samples:
        raise ValueError("evaluate_sft: no samples")
    nll, tokens = 0.0, 0.0
    for start in range(0, len(samples), chunk):
        arrays = collate_sft(list(samples[start: start + chunk]), cluster.pad_token_id)
        part = merge_metrics(gather(fan_out(cluster.trainers, "sft_eval", *[ray.put(a) for a in arrays]),
                                    cluster.timeout_s))
        nll += part["eval/loss_sft"] * part["eval/sft_tokens"]  # the chunk's mean back to a sum
        tokens += part["eval/sft_tokens"]
    return {"eval/loss_sft": nll / tokens, "eval/sft_tokens": tokens}


def copy_policy_to_reference(cluster: RLCluster) -> None:
    """Make the reference equal to the current policy (after SFT, say). Rank 0's weights go
    to the reference by ref, never through the driver; the other ranks join ZeRO-3 gathers."""
    if cluster.reference is None:
        return
    states = fan_out(cluster.trainers, "full_state", True)
    gather([call(cluster.reference, 0, "load_weights", states[0].ref)] + states[1:], cluster.timeout_s)


def evaluate(cluster: RLCluster, items: Sequence, gen: GenerationConfig, k: int, correct: float = 1.0,
             samples_path: Optional[str] = None, step: int = 0,
             component_names: Optional[Sequence[str]] = None) -> dict:
    """``k`` completions of each item at ``gen`` (its ``n`` is replaced by ``k``) on the
    generators, scored by the reward workers: ``eval_metrics`` (mean reward, accuracy = share
    with reward >= ``correct``, pass@1 and pass@k). With ``samples_path``, every sample is also
    written there as one JSON line (``sample_records``), replacing the file atomically.
    k = 1 at temperature 0 is greedy accuracy; pass@k with k > 1 needs temperature > 0."""
    if not items:
        raise ValueError("evaluate: no evaluation items")
    if k < 1 or (k > 1 and gen.temperature <= 0):
        raise ValueError(f"evaluate: k={k} samples per item at temperature {gen.temperature}; k must be >= 1, "
                         "and pass@k with k > 1 needs temperature > 0 (greedy samples are all the same)")
    rollouts, _ = generate_and_score(cluster, items, gen._replace(n=k), with_ref=False)
    metrics = eval_metrics(rollouts, k, correct, component_names)
    if samples_path is not None:
        write_jsonl_atomic(samples_path, sample_records(rollouts, step, component_names))
    return metrics


def evaluate_accuracy(cluster: RLCluster, items: Sequence, max_new_tokens: int, correct: float = 1.0) -> float:
    """Greedy completions of ``items`` on the generators, scored by the reward workers:
    the share whose reward reaches ``correct``."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, n=1)
    return evaluate(cluster, items, gen, k=1, correct=correct)["eval/accuracy"]


def save_cluster_checkpoint(cluster: RLCluster, path: str, state: TrainState) -> str:
    """Trainer shards with optimizer and RNG, an HF copy, the reference weights and the
    ``TrainState`` (data position, versions, metrics), written atomically to ``path``."""
    import shutil

    extra = {}
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
    import os

    saved = gather(fan_out(cluster.trainers, "load_checkpoint", path), cluster.timeout_s)[0]
    state = state_from_json(saved)
    if cluster.reference is not None and os.path.isdir(os.path.join(path, "reference")):
        gather([call(cluster.reference, 0, "load_weights_from", os.path.join(path, "reference"))], cluster.timeout_s)
    if cluster.generators is not None:  # an SFT job has no generators
        sync_weights(cluster, state.policy_version)
    return state
