"""Checks of a job's resume, before anything loads: the checkpoint is one a job wrote, has a step left to
train, and belongs to a run whose training settings the job keeps (``resume_change_errors``)."""
from __future__ import annotations

import json
import os
from typing import Optional

from cluster.jobs.config import EMBEDDED_MODELS, RLJob, embedded_model_dir, record_to_dict


def resume_errors(path: str, steps: Optional[tuple] = None, found: bool = False) -> list:
    """Why ``path`` is not a cluster checkpoint (as ``checkpoint.every`` writes), if it is not; with
    ``steps`` (``(field, value)``: an RL job's ``("algorithm.steps", n)``), also when the checkpoint is
    at that step or past it: the run would train nothing and write an empty history over its outputs.
    One ``found`` by ``resume: auto`` may be at that step, the run's last (its driver killed before the
    final outputs, as the k8s RayJob's retry finds it): that resume finishes the run; past it, not."""
    state = os.path.join(path, "train_state.json")
    if not os.path.isfile(state):
        return [f"checkpoint.resume {path}: not a checkpoint directory (no train_state.json)"]
    if not os.path.isdir(os.path.join(path, "deepspeed")):
        kind = ("a single-process checkpoint (primitives.io.checkpoint.save_checkpoint: optimizer.pt, rng.pt)"
                if os.path.isfile(os.path.join(path, "rng.pt")) else "not a cluster checkpoint")
        return [f"checkpoint.resume {path}: {kind}; a job resumes from a cluster checkpoint written by "
                "checkpoint.every (deepspeed/, train_state.json)"]
    if steps is not None:
        field, last = steps
        try:
            with open(state) as f:
                done = int(json.load(f)["iteration"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"checkpoint.resume {path}: train_state.json has no step to continue from ({e})"]
        if done > last or (done == last and not found):
            return [f"checkpoint.resume {path} is at step {done}, {field} is {last}: nothing is left to train; "
                    f"raise {field} to train on"]
    return []


# What a resume may change and still continue the same run: where and when it writes, how it is evaluated,
# the cluster's shape, where and with which kernels the model runs and how the generators batch their decoding
# (the same distributions at another speed or memory; the random draws may fall otherwise, so the run no longer
# takes the very steps a straight one would: needed to resume a run that ran out of memory). The job's step
# count (``steps_field``) may change too: raising it is what a resume to train on does. Two of them are compared
# where they do change training (``_free``): the model's path (compared once resolved, but for a LoRA run's base
# after a full-weight SFT stage, which the checkpoint decides), and evaluation where the eval prompts are held
# out of the training file or a metric schedule watches an evaluation.
RESUME_FREE = ("checkpoint", "logging", "eval", "cluster", "model.model_name_or_path", "model.device",
               "model.attn_implementation", "generation.decode", "generation.max_batch_rows")
RUN_CONFIG = "config.yaml"  # a run's resolved settings, in <out> (cluster.jobs.outputs.start_output)
MISSING = object()


def resume_changes(path: str, job, steps_field: str) -> list:
    """``(field, before, now)`` for each training setting of ``job`` that differs from the run that wrote
    the checkpoint ``path`` (``<run>/checkpoints/step_N``; that run's ``config.yaml``), outside what a resume
    may change (``RESUME_FREE``, ``steps_field``); ``[]`` where the checkpoint has no run config beside it. A
    dict-valued field (kwargs, overrides) is one value; a list of records (rewards) one value too, its records
    compared on the fields both hold: only the fields both configs hold are compared (one written by another
    version of the code may lack a field or hold an old one). An unreadable run config is a ``ValueError``."""
    import yaml

    parent = os.path.dirname(os.path.abspath(path))
    saved = os.path.join(os.path.dirname(parent), RUN_CONFIG)
    if os.path.basename(parent) != "checkpoints" or not os.path.isfile(saved):
        return []
    try:
        with open(saved) as f:
            before = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{saved} cannot be read ({e})") from e
    if not isinstance(before, dict):
        raise ValueError(f"{saved} holds no settings")
    changes = []
    for key, now in _leaves(job):
        old = _at(before, key)
        if old is not MISSING and not _free(key, job, steps_field) and not _same(key, old, now):
            changes.append((key, old, now))
    return changes


def _leaves(record, prefix: str = ""):
    """``(dotted field, plain value)`` of every field of ``record``, into its record-valued fields."""
    for name, value in record._asdict().items():
        if hasattr(value, "_asdict"):
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", record_to_dict(value)


def _at(tree: dict, key: str):
    """The value at dotted ``key`` of nested dicts, or ``MISSING``."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def _free(key: str, job, steps_field: str) -> bool:
    """Whether a resume may change ``key`` (``RESUME_FREE``, with its two exceptions)."""
    section = key.split(".")[0]
    if key == "model.model_name_or_path":  # a LoRA run's base after a full-weight SFT stage: the checkpoint's
        return bool(isinstance(job, RLJob) and job.model.lora.enabled and job.sft.full_weights)
    if section == "eval" and isinstance(job, RLJob):
        held_out = job.data.task is None and job.data.eval_set.size is not None
        watched = job.schedule.kind == "metric" and job.schedule.metric.startswith("eval/")
        if watched or (held_out and key == "eval.enabled"):
            return False
    return key == steps_field or any(key == f or key.startswith(f + ".") for f in RESUME_FREE)


def _same(key: str, old, now) -> bool:
    """Equal settings: a model path once resolved (an embedded model, built by each run where it puts it, by its
    directory's name); records in a list on the fields both hold."""
    if key == "model.model_name_or_path":
        if now in EMBEDDED_MODELS:
            return os.path.basename(os.path.normpath(str(old))) == os.path.basename(embedded_model_dir(now, ""))
        return os.path.realpath(str(old)) == os.path.realpath(str(now))
    if isinstance(old, list) and isinstance(now, list) and len(old) == len(now):
        return all(a.keys() & b.keys() and all(a[k] == b[k] for k in a.keys() & b.keys())
                   if isinstance(a, dict) and isinstance(b, dict) else a == b for a, b in zip(old, now))
    return old == now


def resume_change_errors(path: str, job, steps_field: str) -> list:
    """A resume that changes training settings (``resume_changes``) would continue the run that wrote the
    checkpoint under other settings, silently (a k8s RayJob re-applied with an edited config and the same
    ``logging.out`` resumes ``auto`` from the earlier experiment's checkpoint): refused, the changes named,
    unless ``checkpoint.allow_changes``, when they are printed."""
    try:
        changes = resume_changes(path, job, steps_field)
    except ValueError as e:
        if job.checkpoint.allow_changes:
            print(f"checkpoint.resume {path}: not compared with the run's settings: {e}", flush=True)
            return []
        return [f"checkpoint.resume {path}: the settings of the run that wrote the checkpoint are not known: {e}; "
                f"set checkpoint.allow_changes true to continue it without comparing"]
    if not changes:
        return []
    listed = "; ".join(f"{k} {before!r} -> {now!r}" for k, before, now in changes)
    if job.checkpoint.allow_changes:
        print(f"checkpoint.resume {path}: continuing with changed settings: {listed}", flush=True)
        return []
    saved = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), RUN_CONFIG)
    return [f"checkpoint.resume {path}: this job changes settings of the run that wrote the checkpoint ({saved}): "
            f"{listed}. A resume continues that run: give logging.out another directory to start a new one, or "
            f"set checkpoint.allow_changes true to continue it with these settings"]
