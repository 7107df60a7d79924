"""The SFT loop: ``train_sft`` and ``evaluate_sft`` over any backend of ``cluster.loop.protocol``
(its ``sft_step`` and ``sft_eval``): a trainer group or one process."""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

import numpy as np
from tqdm import tqdm

from cluster.loop.protocol import Backend
from cluster.loop.train import Hooks, checkpoint_due
from primitives.io.data import SFTSample, collate_sft
from primitives.maths.metrics import merge_metrics


class SFTRun(NamedTuple):
    """How an SFT run draws and how long it trains (``train_sft``'s settings)."""

    num_steps: int
    batch_size: int  # samples per step, all ranks together
    lr_schedule: Callable[[int], float]  # step -> learning rate
    seed: int = 0  # seeds the draws
    log_every: int = 1  # the logger every N steps (and at evaluations and the last)
    start_step: int = 0  # continue a run from a checkpoint at this step
    progress: bool = True  # a tqdm bar


def train_sft(backend: Backend, samples: Sequence[SFTSample], run: SFTRun, hooks: Hooks = Hooks(),
              eval_samples: Sequence[SFTSample] = ()) -> dict:
    """Supervised fine-tuning on ``backend``'s trainer ranks (``cluster.loop.protocol``; the
    weights stay there: a sync sends them on), with the settings of ``run`` and the ``hooks``
    (the RL loop's ``Hooks`` record: ``logger``, ``eval_every``, ``checkpoint_fn``, ``checkpoint_every``,
    ``checkpoint_minutes``).

    Each step draws ``run.batch_size`` samples (seeded, without replacement within the step);
    every trainer rank takes its share and the loss is normalised by the step's global
    target-token count. With ``eval_samples``, the held-out loss (``eval/loss_sft``) is
    logged every ``hooks.eval_every`` steps and at the end; ``hooks.checkpoint_fn(backend,
    step)`` runs every ``hooks.checkpoint_every`` steps and after the first step that ends
    ``hooks.checkpoint_minutes`` after the start or the last checkpoint. ``run.start_step``
    continues a run from a checkpoint: the draws of the steps before it are replayed, so the
    run goes on as if never stopped. Returns the last step's metrics.
    """
    num_steps, batch_size, lr_schedule, seed = run.num_steps, run.batch_size, run.lr_schedule, run.seed
    log_every, start_step, progress = run.log_every, run.start_step, run.progress
    logger, eval_fn, eval_every = hooks.logger, hooks.eval_fn, hooks.eval_every
    checkpoint_fn, checkpoint_every = hooks.checkpoint_fn, hooks.checkpoint_every
    if eval_fn is not None:
        raise ValueError("train_sft evaluates the held-out loss on eval_samples; hooks.eval_fn would be ignored")
    if hooks.iteration_hook is not None:
        raise ValueError("hooks.iteration_hook(state, batch) is the RL loop's (cluster.loop.train.train); train_sft "
                         "calls logger(metrics) and checkpoint_fn only")
    if not samples:
        raise ValueError("train_sft: no samples")
    if hooks.checkpoint_minutes < 0:
        raise ValueError(f"hooks.checkpoint_minutes must be >= 0, got {hooks.checkpoint_minutes}")
    rng = np.random.default_rng(seed)
    pad = backend.pad_token_id
    backend.prepare_recovery()  # what a rank that dies is restored from (Ray; nothing in one process)
    size = min(batch_size, len(samples))
    for _ in range(start_step):
        rng.choice(len(samples), size, replace=False)
    metrics: dict = {}
    last_saved = time.perf_counter()
    bar = tqdm(range(start_step, num_steps), desc="sft", unit="step", **({} if progress else {"disable": True}))
    for step in bar:
        picked = rng.choice(len(samples), size, replace=False)
        stats = backend.sft_step(collate_sft([samples[i] for i in picked], pad), lr_schedule(step))
        metrics = {**merge_metrics(stats), "step": step, "phase": "sft"}
        last = step + 1 == num_steps
        evaluated = bool(eval_samples) and eval_every > 0 and ((step + 1) % eval_every == 0 or last)
        if evaluated:
            metrics.update(evaluate_sft(backend, eval_samples))
            bar.set_postfix(eval_loss=f"{metrics['eval/loss_sft']:.4f}")
        if step % log_every == 0 or last or evaluated:
            logger(metrics)
        if checkpoint_fn is not None and checkpoint_due(step + 1, checkpoint_every, hooks.checkpoint_minutes,
                                                        last_saved):
            checkpoint_fn(backend, step + 1)
            last_saved = time.perf_counter()
    return metrics


def evaluate_sft(backend: Backend, samples: Sequence[SFTSample], chunk: int = 256) -> dict:
    """Held-out SFT loss: the mean NLL per target token over ``samples`` (no update), computed
    on the trainer ranks ``chunk`` samples at a time; ``eval/sft_tokens`` is the token count."""
    if not samples:
        raise ValueError("evaluate_sft: no samples")
    nll, tokens = 0.0, 0.0
    for start in range(0, len(samples), chunk):
        part = merge_metrics(backend.sft_eval(collate_sft(list(samples[start: start + chunk]), backend.pad_token_id)))
        nll += part["eval/loss_sft"] * part["eval/sft_tokens"]  # the chunk's mean back to a sum
        tokens += part["eval/sft_tokens"]
    return {"eval/loss_sft": nll / tokens, "eval/sft_tokens": tokens}
