"""A trainer rank that dies in SFT steps - the SFT job's, or an RL job's SFT stage - is recovered as
in RL: the group is rebuilt, restored to the last snapshot, the SFT steps since are made again,
and the run ends with the undisturbed run's weights (within 1e-5) and every step's loss, the
recovery in its summary. The kill comes from outside, by PID (``tests/chaos.py``), in a step after
the tenth."""
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from cluster.jobs.sft import run_sft
from tests.chaos import actor_pids
from tests.cluster.test_job import _sft_job
from tests.conftest import DEFAULT_JOB, ray_up, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def kill_a_trainer_in_sft_after(out: str, step: int, done: dict, timeout_s: float = 300.0) -> threading.Thread:
    """A thread that waits until ``<out>/metrics.jsonl`` logs SFT step ``step``, then SIGKILLs a
    trainer rank inside its next ``sft_step`` call; ``done`` gets the pid and the last step logged."""
    def logged() -> int:
        path = os.path.join(out, "metrics.jsonl")
        if not os.path.exists(path):
            return -1
        with open(path) as f:
            steps = [r["step"] for r in map(json.loads, f) if r.get("phase") == "sft"]
        return max(steps, default=-1)

    def watch() -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline and logged() < step:
            time.sleep(0.01)
        while time.time() < deadline:
            pids = actor_pids("TrainerWorker", "sft_step")
            if pids:
                os.kill(pids[-1], signal.SIGKILL)
                done.update(pid=pids[-1], after=logged())
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def losses(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss/sft"]) for r in map(json.loads, f) if r.get("phase") == "sft" and "loss/sft" in r]


def same_losses(a: str, b: str, steps: int) -> None:
    """Every SFT step of both runs logged once, with the same loss (1e-5)."""
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb] == list(range(steps))
    assert [x for _, x in la] == pytest.approx([x for _, x in lb], abs=1e-5)


def same_weights(a: str, b: str) -> None:
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_allclose(wa[name], wb[name], rtol=0, atol=1e-5, err_msg=name)


def test_the_sft_job_survives_a_trainer_death(tmp_path, tiny_model_path):
    ray_up()

    def job(out: str):  # a snapshot every 4 steps: the steps since are made again
        made = _sft_job(tmp_path, tiny_model_path, out, 24)
        return made._replace(cluster=made.cluster._replace(snapshot_every=4))

    calm = run_sft(job("calm"))
    done: dict = {}
    thread = kill_a_trainer_in_sft_after(str(tmp_path / "killed"), 10, done)
    killed = run_sft(job("killed"))
    thread.join(5)
    assert done.get("after", -1) >= 10, done  # killed mid-run, not before or after it
    faults = killed["faults"]
    assert faults["restarts"] == {"trainer": 1} and faults["failed_recoveries"] == {}, faults
    assert faults["recoveries"][0]["replayed"] <= 4  # at most the steps since the last snapshot
    same_losses(str(tmp_path / "killed"), str(tmp_path / "calm"), 24)
    same_weights(os.path.join(calm["hf_model"], "model.safetensors"),
                 os.path.join(killed["hf_model"], "model.safetensors"))
    assert calm["faults"]["restarts"] == {}


def test_an_rl_jobs_sft_stage_survives_a_trainer_death(tmp_path):
    with open(DEFAULT_JOB) as f:
        values = yaml.safe_load(f)
    values["cluster"]["snapshot_every"] = 4
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(values))
    args = ["--sft.steps", "24", "--algorithm.steps", "2", "--algorithm.prompts-per-step", "8",
            "--eval.enabled", "False"]
    calm, out = str(tmp_path / "calm"), str(tmp_path / "killed")
    run_job(["rl", str(path), "--logging.out", calm, *args])
    done: dict = {}
    thread = kill_a_trainer_in_sft_after(out, 10, done)
    summary = run_job(["rl", str(path), "--logging.out", out, *args])
    thread.join(5)
    assert done.get("after", -1) >= 10, done
    assert summary["faults"]["restarts"] == {"trainer": 1}, summary["faults"]
    same_losses(out, calm, 24)
    same_weights(os.path.join(calm, "final_model", "hf", "model.safetensors"),
                 os.path.join(out, "final_model", "hf", "model.safetensors"))
