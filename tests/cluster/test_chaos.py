"""The chaos test (issues 22 and 33): the default task through ``rayrl rl`` with every role an actor
of its own - 2 trainer ranks, a 2-rank critic (PPO), a reference worker, a generator, a reward
worker - on three simulated nodes (``tests.chaos.Nodes``: the driver's head, a trainer node with
the trainers, critics and reference, a generator node with the generator and reward worker; Ray's
inline limit at 1 KB, so every chunk and snapshot part lives in the object store of the node that
made it, as a real model's do above 100 KB). A monkey outside the run kills one actor of a random
role by PID (SIGKILL) every two steps, and loses the whole generator node and, later, the whole trainer
node (a fresh one joins in each's place). The run must complete every step, train every prompt exactly
once, and end with the final weights of the same run undisturbed (within 1e-5), its recoveries in
the summary and nothing of ours left in /dev/shm.

Until issue 32 the trainer node was lost in a run of its own (the calm run's 13 steps again, 75 s
here); the disturbed run now loses it as its last event, which the same assertions hold."""
import json
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import yaml

from tests.chaos import ROLE_CLASSES, Nodes, actor_pids, our_scratch
from tests.conftest import run_job

# three simulated nodes of its own; apart: most of its time is Ray noticing a lost node (its default health checks)
pytestmark = [pytest.mark.ray, pytest.mark.own_ray, pytest.mark.apart]

# the last event comes once step 13 is logged (seen at 14 in every run here, the monkey a step behind): two steps
# of training left for it to land in, and a third to spare
STEPS = 16
# the default job's task and model, every role an actor of its own, PPO (a critic) with a KL reference
JOB = {"model": {"model_name_or_path": "tiny"},
       "data": {"task": "arithmetic", "task_kwargs": {"num_train": 40, "num_heldout": 16}},
       "rewards": [{"name": "exact_match", "kwargs": {"parser": "first_number"}}],
       "algorithm": {"name": "ppo", "kl_coef": 0.02, "steps": STEPS, "prompts_per_step": 8, "lr": 3.0e-4},
       "generation": {"group_size": 4, "max_new_tokens": 5, "temperature": 1.0},
       "sft": {"steps": 20, "batch": 16, "lr": 1.0e-3, "eval_every": 0},
       "cluster": {"generators": 1, "trainers": 2, "critics": 2, "reward_workers": 1, "reference_workers": 1,
                   "zero_stage": 2, "micro_batch_size": 16, "max_restarts": 20, "pin_roles": True,
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
           started: float, nodes: Nodes, first: int = 1) -> None:
    """After RL steps ``first``, ``first + every``, ... are logged, SIGKILL one process of the next role in
    ``roles`` (a random rank, after a random pause so that it may be inside a call) that started
    after ``started`` (the run's, not the calm run's); a role ``node:<group>`` loses that whole
    node instead, and a fresh node joins in its place."""
    next_at = first
    while not stop.is_set() and roles:
        if _rl_steps(out) >= next_at:
            role = roles.pop(0)
            time.sleep(rng.uniform(0.0, 0.3))
            if role.startswith("node:"):
                killed.append((role, None, _rl_steps(out)))  # counted before: a step may be logged while it goes
                nodes.remove(role[5:])
                nodes.add(role[5:])
                next_at += every
                continue
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


def _last_rl_metrics(out: str) -> dict:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"algorithm"' in line][-1]


@pytest.fixture(scope="module")
def three_nodes():
    """The module's simulated cluster; each run's own new processes (no kept actors: the monkey kills
    the disturbed run's alone)."""
    from cluster.ray_wing.pool import REUSE_ENV, release_unclaimed

    release_unclaimed()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(REUSE_ENV, "0")
        nodes = Nodes({"trainer": 6, "generator": 3}, inline_bytes=1024)
        try:
            yield nodes
        finally:
            nodes.shutdown()


@pytest.fixture(scope="module")
def calm(three_nodes, tmp_path_factory):
    """The job undisturbed on the three nodes: ``(config, out, time.time() before it started)``."""
    tmp = tmp_path_factory.mktemp("chaos")
    config, out, started = _config(tmp), str(tmp / "calm"), time.time()
    run_job(["rl", config, "--logging.out", out])
    return config, out, started


def _assert_undisturbed(out: str, calm_out: str, what) -> None:
    """``out``'s run trained the calm run's prompts at every step, each once, and ended with its weights."""
    ledger, calm_ledger = _ledger(out), _ledger(calm_out)
    assert [e["step"] for e in ledger] == list(range(STEPS))
    assert ledger == calm_ledger  # every step trained the prompts of the undisturbed run's step
    trained = [g for e in ledger for g in e["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * 8  # each prompt once per epoch (40 prompts, 128 groups)

    calm_w, w = _weights(calm_out), _weights(out)
    assert calm_w.keys() == w.keys()
    diff = max(float(np.abs(calm_w[k].astype(np.float64) - w[k]).max()) for k in calm_w)
    assert diff <= 1e-5, f"final weights differ by {diff} after {what}"


def _run_with_monkey(config: str, out: str, monkey_args: tuple) -> tuple:
    """``(summary, killed)`` of the job at ``config`` written to ``out`` while ``monkey(out, roles,
    every, rng, stop, killed, started, nodes[, first])`` (``monkey_args`` from ``roles`` on) acts."""
    roles, every, rng, *rest = monkey_args
    stop, killed = threading.Event(), []
    thread = threading.Thread(target=monkey, args=(out, roles, every, rng, stop, killed, *rest), daemon=True)
    thread.start()
    try:
        summary = run_job(["rl", config, "--logging.out", out])
    finally:
        stop.set()
        thread.join(5)
    return summary, killed


@pytest.mark.slow
def test_chaos_run_ends_with_the_undisturbed_weights(calm, three_nodes, tmp_path):
    config, calm_out, started = calm
    assert _last_rl_metrics(calm_out)["faults/kept_mb"] > 0  # chunks and snapshot parts crossed to the head

    rng = random.Random(22)
    roles = list(ROLE_CLASSES)
    rng.shuffle(roles)
    roles.insert(2, "node:generator")  # the generator and the reward worker at once, and their chunks
    # every trainer and critic rank, the reference worker and the objects they made (the snapshot parts are
    # kept on the head): the groups are rebuilt on the fresh node from the snapshot and the updates since
    roles.append("node:trainer")
    out = str(tmp_path / "chaos")
    summary, killed = _run_with_monkey(config, out, (list(roles), 2, rng, started, three_nodes))

    print("killed (role, pid, steps logged):", killed)
    print("recoveries:", summary["faults"]["recoveries"])
    assert our_scratch() == []  # what the killed ranks left in /dev/shm went with the run
    assert sorted(role for role, _, _ in killed) == sorted([*ROLE_CLASSES, "node:generator", "node:trainer"]), killed
    assert all(step < STEPS for _, _, step in killed), killed  # while the run was training
    faults = summary["faults"]
    assert sorted(faults["restarts"]) == sorted(ROLE_CLASSES), faults
    # one per kill, one more for the generator node's second actor and two more for the trainer node's (three
    # rebuilt: the trainer group, the critic group, the reference worker); more when a re-formed sync group hung
    assert sum(faults["restarts"].values()) >= len(killed) + 1 + 2, faults
    # and each node's loss took its roles: every role is hit twice (a kill, and its node's loss or a second kill)
    assert all(n >= 2 for n in faults["restarts"].values()), faults
    assert summary["rl_steps"] == STEPS
    _assert_undisturbed(out, calm_out, killed)
