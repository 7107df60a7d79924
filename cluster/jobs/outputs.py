"""What a job writes and reports: the run directory (config, metrics, curves, summary), the
summary's figures (phase means, medians of the learning signals, start-up seconds, accuracy).
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional, Sequence

import numpy as np

from cluster.jobs.config import (
    SFTJob,
    dump_config,
    record_to_dict,
)
from cluster.jobs.resume import RUN_CONFIG

# the learning signal and the generator/trainer gap, summarised as medians over the RL steps
SIGNALS = ("loss/policy", "loss/kl", "kl/ref_k3", "policy/clip_frac", "policy/entropy", "grad_norm",
           "mismatch/k3", "mismatch/max_abs_logp_diff", "mismatch/is_weight_mean", "mismatch/is_clipped_frac")


PHASES = ("time/generate", "time/reward", "time/ref", "time/train", "time/sync", "time/step")


# What a job writes in <out>, its run's outputs (<out>/base_model, the tiny model made from the seed, is an input)
RUN_OUTPUTS = (RUN_CONFIG, "metrics.jsonl", "summary.json", "curves.png", "samples", "trained_groups.jsonl",
               "checkpoints", "final_model", "sft_model")
EARLIER = "earlier"  # <out>/earlier/<UTC time>/: an earlier run's outputs, set aside by a fresh start


def set_aside_earlier_run(out: str, reads: Sequence[Optional[str]] = ()) -> Optional[str]:
    """A job that starts afresh in ``out`` where an earlier run left its outputs (``RUN_OUTPUTS``)
    moves them into ``<out>/earlier/<UTC time>/`` first and returns that path (None: nothing moved).
    Left in place, its metrics would be deleted, its ledger of trained groups and its samples mixed
    with the new run's, and its checkpoints, of higher steps, would outrank the new run's: the pruning
    would remove the new ones and a later ``--checkpoint.resume auto`` continue the earlier run. A job
    that reads any of those outputs (``reads``: the checkpoint it resumes from, its model, a LoRA
    resume's base; paths compared once links are resolved) continues that run in place, and nothing
    moves; anything else in ``out`` is left alone."""
    found = [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(out, name))]
    inside = [os.path.realpath(os.path.join(out, name)) for name in found]
    for path in filter(None, reads):
        real = os.path.realpath(path)
        if any(os.path.commonpath([real, entry]) == entry for entry in inside):
            return None
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside, k = os.path.join(out, EARLIER, stamp), 1
    while os.path.lexists(aside):
        k += 1
        aside = os.path.join(out, EARLIER, f"{stamp}-{k}")
    os.makedirs(aside)
    for name in found:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
    print(f"{out} held an earlier run's outputs ({', '.join(found)}): moved to {aside} (this run starts afresh; "
          f"delete it when it is no longer needed)", flush=True)
    return aside


def start_output(job) -> tuple:
    """Create ``<out>`` (an earlier run's outputs set aside where this run starts afresh:
    ``set_aside_earlier_run``), save the resolved config there, and return ``(logger, metrics_path)``."""
    from primitives.io.loggers import multi_logger, run_logger, wandb_logger

    out = job.logging.out
    print(f"writing outputs to {out}", flush=True)
    set_aside_earlier_run(out, [job.checkpoint.resume, job.model.model_name_or_path])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RUN_CONFIG + ".tmp"), "w") as f:  # whole or not at all: a resume compares with it
        f.write(dump_config(job))
    os.replace(os.path.join(out, RUN_CONFIG + ".tmp"), os.path.join(out, RUN_CONFIG))
    keys = ["loss/sft", "eval/loss_sft", "reward/mean", "eval/accuracy", "kl/ref_k3"]
    earlier = rows_before_resume(out, job.checkpoint.resume, "sft" if isinstance(job, SFTJob) else None)
    logger, metrics_path = run_logger(out, keys, every=job.logging.console_every)
    if earlier:
        with open(metrics_path, "w", encoding="utf-8") as f:
            f.writelines(earlier)
    if job.logging.wandb_project:
        logger = multi_logger(logger, wandb_logger(job.logging.wandb_project, config=record_to_dict(job),
                                                   directory=out))
    return logger, metrics_path


def rows_before_resume(out: str, resume: Optional[str], phase: Optional[str]) -> list:
    """The lines of ``<out>/metrics.jsonl`` a run resuming in place (from ``<out>/checkpoints/step_N``)
    keeps: those of other phases (an RL job's SFT stage, ``phase: sft``, which a resume does not repeat) and
    of the resumed ``phase`` (None: RL steps) before step N; the steps from N on are trained again, so a killed
    run's rows past its checkpoint go, and so does an evaluation's own row at step N - 1 (an earlier resume's
    evaluation at the checkpoint, which this run makes again). A malformed line (a write cut by the kill) goes.
    Nothing from a checkpoint of another run (its metrics are that run's) or when not resuming."""
    path = os.path.join(out, "metrics.jsonl")
    if not resume or not os.path.isfile(path):
        return []
    parent = os.path.dirname(os.path.abspath(resume))
    if os.path.basename(parent) != "checkpoints" or os.path.realpath(os.path.dirname(parent)) != os.path.realpath(out):
        return []
    try:
        with open(os.path.join(resume, "train_state.json")) as f:
            done = int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or (row.get("phase") == phase and (row.get("step", done) >= done or (
                    row.get("step") == done - 1 and all(k == "step" or k.startswith("eval/") for k in row)))):
                continue  # trained again, or the evaluation at the checkpoint the resumed run makes again
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def finish_output(job, metrics_path: str, plot_keys, title: str, summary: dict) -> dict:
    from primitives.io.loggers import plot_curves, write_summary

    out = job.logging.out
    rows = [json.loads(line) for line in open(metrics_path)]
    plot_curves(rows, [k for k in plot_keys if any(k in r for r in rows)], os.path.join(out, "curves.png"),
                title=title)
    summary = write_summary(out, summary)
    print(f"outputs (config.yaml, summary.json, metrics.jsonl, curves.png, final_model/) are in {out}", flush=True)
    return summary


def save_step_checkpoint(backend, out: str, state, keep: int) -> str:
    """Checkpoint ``backend`` with ``state`` into ``<out>/checkpoints/step_N`` (N:
    ``state.iteration``), then remove the older ones there beyond the newest ``keep`` (0: keep all)."""
    from primitives.io.checkpoint import prune_checkpoints

    directory = os.path.join(out, "checkpoints")
    path = os.path.join(directory, f"step_{state.iteration}")
    backend.save(path, state)
    prune_checkpoints(directory, keep, path)
    return path


def phase_means(history) -> dict:
    return {k.replace("time/", "time_") + "_mean_s": round(float(np.mean([m[k] for m in history if k in m])), 4)
            for k in PHASES if any(k in m for m in history)}


def medians(history, keys) -> dict:
    return {k: float(np.median([m[k] for m in history if k in m])) for k in keys if any(k in m for m in history)}


# ----------------------------------------------------------------------------- RL


def process_start_time() -> float:
    """When this process started (``time.time()`` scale), to 10 ms: its start in clock ticks
    since boot (``/proc/self/stat``) against the boot-time clock. psutil's ``create_time`` is
    not used: it adds the boot time in whole seconds and was up to 1 s early. Elsewhere, the
    time ``cluster`` was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        from cluster import IMPORTED_AT

        return IMPORTED_AT


def startup_figures(process_start: float, run_start: float, cluster_start: float, stages: dict) -> dict:
    """``startup_s``: seconds from the process start to the cluster ready for the first RL step,
    SFT steps and evaluations left out; ``startup``: the seconds of each stage in order
    (``first_step``, the first RL step itself, is reported but not counted)."""
    stages = {"driver_start": round(run_start - process_start, 3), "prepare": round(cluster_start - run_start, 3),
              **stages}
    return {"startup_s": round(sum(v for k, v in stages.items() if k != "first_step"), 2), "startup": stages}


def accuracy_figures(before: dict, after: dict) -> dict:
    """The summary's eval figures before and after RL (``{}`` when evaluation is off)."""
    if not before:
        return {}
    return {"accuracy_before_rl": before["eval/accuracy"], "accuracy_after_rl": after["eval/accuracy"],
            "accuracy_gain_points": round(100 * (after["eval/accuracy"] - before["eval/accuracy"]), 2),
            "eval_reward_mean_before": before["eval/reward_mean"], "eval_reward_mean_after": after["eval/reward_mean"]}
