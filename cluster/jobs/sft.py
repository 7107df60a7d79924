"""The SFT job behind ``rayrl sft``: the trainer ranks alone, eval loss, checkpoints, the final model.
"""
from __future__ import annotations

import json
import os
import sys
import time

from cluster.jobs.config import (
    SFTJob,
)
from cluster.jobs.inputs import prepare_sft
from cluster.jobs.outputs import finish_output, save_step_checkpoint, start_output
from cluster.ray_wing.config import trainer_config


def run_sft(job: SFTJob) -> dict:
    """The SFT job: check and load (no Ray), train on the trainer group with eval loss,
    checkpoints every ``checkpoint.every`` steps or ``checkpoint.minutes`` (the newest
    ``checkpoint.keep`` kept) and the final model (HF in ``final_model/hf``)."""
    from cluster.loop.sft import SFTRun, evaluate_sft, train_sft
    from cluster.loop.train import Hooks
    from cluster.ray_wing.backend import job_backend
    from cluster.ray_wing.roles import build_sft_cluster, shutdown_cluster
    from cluster.ray_wing.weights import load_cluster_checkpoint
    from primitives.model.training import linear_warmup
    from primitives.types import TrainState

    job, samples, eval_samples = prepare_sft(job)
    start, out, sft = time.time(), job.logging.out, job.sft
    logger, metrics_path = start_output(job)
    trainer_cfg = trainer_config(job.cluster, sft.lr)
    backend = job_backend(build_sft_cluster(job.model, job.cluster, trainer_cfg, seed=job.seed), job.cluster)
    try:
        resume = job.checkpoint.resume
        first = load_cluster_checkpoint(backend.cluster, resume).iteration if resume else 0  # checked: <= sft.steps
        before = evaluate_sft(backend, eval_samples)["eval/loss_sft"] if eval_samples else None
        save = lambda b, step: save_step_checkpoint(  # noqa: E731
            b, out, TrainState(iteration=step, global_step=step), job.checkpoint.keep)
        last = train_sft(backend, samples,
                         SFTRun(sft.steps, sft.batch, linear_warmup(sft.lr, sft.warmup), seed=job.seed,
                                start_step=first),
                         Hooks(logger=logger, eval_every=sft.eval_every or sft.steps, checkpoint_fn=save,
                               checkpoint_every=job.checkpoint.every, checkpoint_minutes=job.checkpoint.minutes),
                         eval_samples=eval_samples)
        backend.save(os.path.join(out, "final_model"), TrainState(iteration=sft.steps, global_step=sft.steps))
    finally:  # the group as it ended (rebuilt, if a rank died)
        shutdown_cluster(backend.cluster, keep=sys.exc_info()[0] is None)  # a failed run's actors are not kept
    rows = [json.loads(line) for line in open(metrics_path)]
    summary = {"sft_steps": sft.steps, "resumed_at_step": first, "train_samples": len(samples),
               "eval_samples": len(eval_samples), "loss_sft_first": rows[0].get("loss/sft") if rows else None,
               "loss_sft_last": last.get("loss/sft"), "eval_loss_before": before,
               "eval_loss_after": last.get("eval/loss_sft"), "model": job.model.model_name_or_path,
               "trainer_ranks": job.cluster.trainers, "zero_stage": job.cluster.zero_stage, "seed": job.seed,
               "faults": backend.fault_summary(),
               "wall_s": round(time.time() - start, 1), "out": out, "hf_model": os.path.join(out, "final_model", "hf")}
    return finish_output(job, metrics_path, ["loss/sft", "eval/loss_sft", "lr"], "SFT on Ray", summary)
