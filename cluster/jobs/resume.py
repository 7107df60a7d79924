"""Checks of a job's resume, before anything loads: the checkpoint is one a job wrote, has a step left to
train, and belongs to a run whose training settings the job keeps (``resume_change_errors``)."""
from __future__ import annotations

import json
import os
from typing import Optional

from cluster.jobs.config import record_to_dict


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
# (the same samples, other speed or memory), and the model's path (a resume takes the checkpoint's weights; runs
# of one model name it differently: an embedded name resolved, a LoRA run's base its SFT stage's model). The
# job's step count (``steps_field``) may change too: raising it is what a resume to train on does.
RESUME_FREE = ("checkpoint", "logging", "eval", "cluster", "model.model_name_or_path", "model.device",
               "model.attn_implementation", "generation.decode", "generation.max_batch_rows")
RUN_CONFIG = "config.yaml"  # a run's resolved settings, in <out> (cluster.jobs.outputs.start_output)


def resume_changes(path: str, job, steps_field: str) -> list:
    """``(field, before, now)`` for each training setting of ``job`` that differs from the run that wrote
    the checkpoint ``path`` (``<run>/checkpoints/step_N``; that run's ``config.yaml``), outside ``RESUME_FREE``
    and ``steps_field``; ``[]`` where the checkpoint has no run config beside it. Only the fields both
    configs hold are compared (one written by another version of the code may lack a field or hold an old one)."""
    import yaml

    parent = os.path.dirname(os.path.abspath(path))
    saved = os.path.join(os.path.dirname(parent), RUN_CONFIG)
    if os.path.basename(parent) != "checkpoints" or not os.path.isfile(saved):
        return []
    with open(saved) as f:
        before = _flat(yaml.safe_load(f) or {})
    free = RESUME_FREE + (steps_field,)
    return [(k, before[k], v) for k, v in _flat(record_to_dict(job)).items()
            if k in before and before[k] != v and not any(k == f or k.startswith(f + ".") for f in free)]


def resume_change_errors(path: str, job, steps_field: str) -> list:
    """A resume that changes training settings (``resume_changes``) would continue the run that wrote the
    checkpoint under other settings, silently (a k8s RayJob re-applied with an edited config and the same
    ``logging.out`` resumes ``auto`` from the earlier experiment's checkpoint): refused, the changes named,
    unless ``checkpoint.allow_changes``, when they are printed."""
    changes = resume_changes(path, job, steps_field)
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


def _flat(tree: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict of dotted keys (lists are values)."""
    out: dict = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
