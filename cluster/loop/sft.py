"""The SFT loop: ``train_sft`` and ``evaluate_sft`` over any backend of ``cluster.loop.protocol``
(its ``sft_step`` and ``sft_eval``): a trainer group or one process."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from primitives.io.data import SFTSample, collate_sft
from primitives.io.loggers import noop_logger
from primitives.maths.metrics import merge_metrics


def train_sft(backend, samples: Sequence[SFTSample], num_steps: int, batch_size: int,
              lr_schedule: Callable[[int], float], seed: int = 0, logger: Callable = noop_logger,
              log_every: int = 1, progress: bool = True, eval_samples: Sequence[SFTSample] = (),
              eval_every: int = 0, checkpoint_fn: Optional[Callable] = None, checkpoint_every: int = 0,
              start_step: int = 0) -> dict:
    """Supervised fine-tuning on ``backend``'s trainer ranks (``cluster.loop.protocol``; the
    weights stay there: a sync sends them on).

    Each step draws ``batch_size`` samples (seeded, without replacement within the step);
    every trainer rank takes its share and the loss is normalised by the step's global
    target-token count. With ``eval_samples``, the held-out loss (``eval/loss_sft``) is
    logged every ``eval_every`` steps and at the end; ``checkpoint_fn(backend, step)`` runs
    every ``checkpoint_every`` steps. ``start_step`` continues a run from a checkpoint: the
    draws of the steps before it are replayed, so the run goes on as if never stopped.
    Returns the last step's metrics.
    """
    if not samples:
        raise ValueError("train_sft: no samples")
    rng = np.random.default_rng(seed)
    pad = backend.pad_token_id
    size = min(batch_size, len(samples))
    for _ in range(start_step):
        rng.choice(len(samples), size, replace=False)
    metrics: dict = {}
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
        if checkpoint_fn is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
            checkpoint_fn(backend, step + 1)
    return metrics


def evaluate_sft(backend, samples: Sequence[SFTSample], chunk: int = 256) -> dict:
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
