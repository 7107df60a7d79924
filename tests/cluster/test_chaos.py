"""The chaos test (issue 22): the default task through ``rayrl rl`` with every role an actor of its
own - 2 trainer ranks, a 2-rank critic (PPO), a reference worker, a generator, a reward worker -
while a monkey outside the run kills one actor of a random role by PID (SIGKILL) every two
steps. The run must complete every step, train every prompt exactly once, and end with the
final weights of the same run undisturbed (within 1e-5), its recoveries in the summary."""
import json
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import yaml

from tests.chaos import ROLE_CLASSES, actor_pids, our_scratch
from tests.conftest import ray_up, run_job

STEPS = 12
# the default job's task and model, every role an actor of its own, PPO (a critic) with a KL reference
JOB = {"model": {"model_name_or_path": "tiny"},
       "data": {"task": "arithmetic", "task_kwargs": {"num_train": 40, "num_heldout": 16}},
       "rewards": [{"name": "exact_match", "kwargs": {"parser": "first_number"}}],
       "algorithm": {"name": "ppo", "kl_coef": 0.02, "steps": STEPS, "prompts_per_step": 8, "lr": 3.0e-4},
       "generation": {"group_size": 4, "max_new_tokens": 5, "temperature": 1.0},
       "sft": {"steps": 20, "batch": 16, "lr": 1.0e-3, "eval_every": 0},
       "cluster": {"generators": 1, "trainers": 2, "critics": 2, "reward_workers": 1, "reference_workers": 1,
                   "zero_stage": 2, "micro_batch_size": 16, "max_restarts": 14,
                   # a re-formed weight-sync group was seen to hang now and then (a generator still in an
                   # older rendezvous): the call timeout takes the pair for stuck and replaces them
                   "call_timeout_s": 60},
       "eval": {"every": 0, "final_pass_k": 0},
       "checkpoint": {"every": 0}}


def _config(tmp_path) -> str:
    path = tmp_path / "chaos.yaml"
    path.write_text(yaml.safe_dump(JOB))
    return str(path)


def _rl_steps(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum('"algorithm"' in line for line in f)


def monkey(out: str, roles: list, every: int, rng: random.Random, stop: threading.Event, killed: list,
           started: float) -> None:
    """After RL steps 1, 1 + ``every``, ... are logged, SIGKILL one process of the next role in
    ``roles`` (a random rank, after a random pause so that it may be inside a call) that started
    after ``started`` (the run's, or the calm run's that the run kept: ``RAYRL_REUSE_ACTORS``)."""
    next_at = 1
    while not stop.is_set() and roles:
        if _rl_steps(out) >= next_at:
            role = roles.pop(0)
            time.sleep(rng.uniform(0.0, 0.3))
            pids = actor_pids(ROLE_CLASSES[role], since=started)
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                killed.append((role, pid, _rl_steps(out)))
            next_at += every
        time.sleep(0.01)


def _weights(out: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(out, "final_model", "hf", "model.safetensors"))


def _ledger(out: str) -> list:
    with open(os.path.join(out, "trained_groups.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_chaos_run_ends_with_the_undisturbed_weights(tmp_path, monkeypatch):
    from cluster.ray_wing.pool import REUSE_ENV, release_unclaimed

    config = _config(tmp_path)
    ray_up()
    release_unclaimed()
    monkeypatch.setenv(REUSE_ENV, "0")  # every run's own new processes: the monkey kills the chaos run's alone
    calm, started = str(tmp_path / "calm"), time.time()
    run_job(["rl", config, "--logging.out", calm])

    rng = random.Random(22)
    roles = list(ROLE_CLASSES)
    rng.shuffle(roles)
    out, stop, killed = str(tmp_path / "chaos"), threading.Event(), []
    thread = threading.Thread(target=monkey, args=(out, list(roles), 2, rng, stop, killed, started), daemon=True)
    thread.start()
    try:
        summary = run_job(["rl", config, "--logging.out", out])
    finally:
        stop.set()
        thread.join(5)

    print("killed (role, pid, steps logged):", killed)
    assert our_scratch() == []  # what the killed ranks left in /dev/shm went with the run
    assert sorted(role for role, _, _ in killed) == sorted(ROLE_CLASSES), killed  # one of each role was killed
    assert all(step < STEPS for _, _, step in killed), killed  # while the run was training
    faults = summary["faults"]
    assert sorted(faults["restarts"]) == sorted(ROLE_CLASSES), faults
    assert sum(faults["restarts"].values()) >= len(killed)  # (more when a re-formed sync group hung: see JOB)
    assert summary["rl_steps"] == STEPS

    ledger, calm_ledger = _ledger(out), _ledger(calm)
    assert [e["step"] for e in ledger] == list(range(STEPS))
    assert ledger == calm_ledger  # every step trained the prompts of the undisturbed run's step
    trained = [g for e in ledger for g in e["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * 8  # each prompt once per epoch (40 prompts, 96 groups)

    calm_w, chaos_w = _weights(calm), _weights(out)
    assert calm_w.keys() == chaos_w.keys()
    diff = max(float(np.abs(calm_w[k].astype(np.float64) - chaos_w[k]).max()) for k in calm_w)
    assert diff <= 1e-5, f"final weights differ by {diff} after {killed}"
