"""Kept actors (``RAYRL_REUSE_ACTORS=1``, ``cluster.ray_wing.pool``): a job on actors an earlier
job's cluster kept computes what it computes on new actors - every logged number of every SFT and
RL step, and the final weights - across ZeRO stages (a trainer kept from a ZeRO-2 job rebuilt for
ZeRO-3 and back), a generator worker, a reward worker and a policy-tracking reference worker. Kept
actors that a new cluster does not take wait beside it for a later one, and past ``RAYRL_KEPT_MAX``
actors the group kept longest ago is killed; a kept actor that died while it waited is replaced by
a new one, the job unchanged. The ZeRO-3 jobs run PPO: their critics are kept as well, and a third
ZeRO-3 job on every role kept equals the one on new actors. (The rest of the suite runs with kept actors,
``tests/conftest.py``; this module compares them with new ones.)"""
import json
import os
import signal
import time

import pytest
import yaml
from safetensors.numpy import load_file

from cluster.ray_wing.pool import KEPT_MAX_ENV, REUSE_ENV, kept_count, release_unclaimed
from tests.chaos import actor_pids
from tests.conftest import DEFAULT_JOB, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# timings, and the snapshots taken by their measured cost (which step logs one is a matter of timing)
TIMING = ("time/", "idle/", "busy/", "memory/", "throughput/", "faults/snapshot_")


def job_file(tmp_path, name: str, **cluster) -> str:
    with open(DEFAULT_JOB) as f:
        values = yaml.safe_load(f)
    values["cluster"].update(generate_on_trainers=False, generators=1, **cluster)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def run(path: str, out: str, *extra) -> tuple:
    """``(summary, logged rows without timings, final weights)`` of 8 SFT and 2 RL steps."""
    summary = run_job(["rl", path, "--logging.out", out, "--sft.steps", "8", "--algorithm.steps", "2",
                       "--algorithm.prompts-per-step", "8", "--eval.enabled", "False", *extra])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in f]
    weights = load_file(os.path.join(out, "final_model", "hf", "model.safetensors"))
    return summary, rows, weights


def same_run(a: tuple, b: tuple) -> None:
    assert len(a[1]) >= 3 and a[1] == b[1]  # every logged value of every step, exactly
    assert a[2].keys() == b[2].keys() and all((a[2][k] == b[2][k]).all() for k in a[2])


def test_jobs_on_kept_actors_equal_jobs_on_new_ones(tmp_path, monkeypatch):
    zero2 = job_file(tmp_path, "zero2")
    zero3 = job_file(tmp_path, "zero3", zero_stage=3, reference_on_trainers=False, critics=2)
    # the reference worker tracks the policy (it joins every sync); PPO adds a 2-rank critic group
    ema = ("--reference.update", "ema", "--algorithm.name", "ppo")
    monkeypatch.setenv(REUSE_ENV, "0")
    release_unclaimed()
    new3 = run(zero3, str(tmp_path / "new3"), *ema)  # new actors, killed at the end
    assert new3[0]["reused_roles"] == [] and kept_count() == 0
    monkeypatch.setenv(REUSE_ENV, "1")
    new2 = run(zero2, str(tmp_path / "new2"))
    assert new2[0]["reused_roles"] == [] and kept_count() == 4  # two trainer ranks, a generator, a reward worker
    kept3 = run(zero3, str(tmp_path / "kept3"), *ema)  # the ZeRO-2 job's trainers and generator
    assert kept3[0]["reused_roles"] == ["trainer", "generator", "reward"]
    assert kept3[0]["zero_stage"] == 3 and kept3[0]["reference"] == "workers"
    kept2 = run(zero2, str(tmp_path / "kept2"))  # the ZeRO-3 job's; its reference worker waits beside it
    assert kept2[0]["reused_roles"] == ["trainer", "generator", "reward"]
    # kept2's own 4, and the ZeRO-3 job's reference worker and critics waiting beside them
    assert kept_count() == 7 and len(actor_pids("RefLogprobWorker")) == 1 and len(actor_pids("CriticWorker")) == 2
    kept3_again = run(zero3, str(tmp_path / "kept3_again"), *ema)  # every role kept, the critics included
    assert sorted(kept3_again[0]["reused_roles"]) == ["critic", "generator", "reference", "reward", "trainer"]
    same_run(new3, kept3)
    same_run(new3, kept3_again)
    same_run(new2, kept2)
    assert any("critic/value_loss" in r for r in new3[1])  # the critics' numbers are among those compared
    assert new2[1] != new3[1]  # the two shapes differ (ZeRO-3, PPO, a moving reference): the equality is not vacuous
    # a kept actor that died while it waited: its role starts anew, and the job is the same
    os.kill(actor_pids("TrainerWorker")[-1], signal.SIGKILL)
    time.sleep(1)
    monkeypatch.setenv(KEPT_MAX_ENV, "4")
    after_death = run(zero2, str(tmp_path / "after_death"))
    assert after_death[0]["reused_roles"] == ["generator", "reward"]
    same_run(new2, after_death)
    # 7 kept would pass the limit of 4: the reference worker and the critics, kept longest ago, went
    assert kept_count() == 4
    deadline = time.monotonic() + 30  # their processes exit a moment after the kill
    while (actor_pids("RefLogprobWorker") or actor_pids("CriticWorker")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert actor_pids("RefLogprobWorker") == [] and actor_pids("CriticWorker") == []
