"""`ray job submit` against a real local head (`ray start --head` on loopback, free ports):
the short default job (`python -m cluster rl examples/configs/default.yaml`) succeeds and
writes its summary and resolved config, and so does a user's own script (an example), the two
submitted at once; then the head is stopped."""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from rl_actors.weight_sync import free_port
from tests.conftest import ROOT

# a real head of its own, the run's Ray shut down first; under make test, in a pytest process of its own beside the
# Ray tests (tests/suite.py): its jobs and their head share nothing with the run's Ray
pytestmark = [pytest.mark.own_ray, pytest.mark.apart]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _stop_head(temp_dir: str, port: int, timeout_s: float = 3.0) -> None:
    """Stop only the Ray processes of this head (their command lines name its temp dir or its GCS
    port) and what they started: `ray stop` would stop every Ray on the machine. The dashboard's
    agents retitle themselves (``ray::DashboardAgent``) and Ray's client server names only the
    GCS's address; one left running holds its port, and the next head on the machine then has no
    agent to take jobs ("No available agent to submit job")."""
    import re

    import psutil

    gone = (psutil.NoSuchProcess, psutil.AccessDenied)
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}  # this test run, whatever its command line says
    ours = re.compile(rf"{re.escape(temp_dir)}|:{port}\b")
    procs = [p for p in psutil.process_iter(["cmdline"]) if ours.search(" ".join(p.info["cmdline"] or []))]
    for p in list(procs):
        try:
            procs += [c for c in p.children(recursive=True) if c not in procs]
        except gone:
            pass
    procs = [p for p in procs if p.pid not in spared]
    for p in procs:
        try:
            p.terminate()
        except gone:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except gone:
            pass


@pytest.fixture(scope="module")
def ray_head():
    """One head for the module's submissions (each job is a driver of its own on it)."""
    import shutil
    import tempfile

    import ray

    ray.shutdown()
    # free ports for the head's dashboard and its agent's HTTP server: the agent's default (52365) is every Ray's on
    # the machine, the tests' own Ray's too, which under make test runs beside this head; an agent that finds it taken
    # serves no HTTP, and the head then takes no jobs ("No available agent to submit job")
    port, dash, agent = free_port(), free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rrh", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    # Ray 2.60 protects a head with a token. Give this head and its clients a fresh one
    # through the environment (nothing written to ~/.ray; a new machine has no token there)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
                    "--num-cpus=8",
                    "--include-dashboard=true", "--disable-usage-stats", f"--temp-dir={temp_dir}"], check=True,
                   env=env, capture_output=True, timeout=120)
    try:
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "env": env}
    finally:
        _stop_head(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _submit(ray_head: dict, root: str, entrypoint: list, prefix: str) -> tuple:
    """``ray job submit`` of ``entrypoint`` with ``--working-dir .`` and ``$RAYRL_OUTPUT_ROOT`` at ``root``,
    tailing its logs until it ends into ``<root>/client.out`` and ``client.err`` (files, not pipes: a pipe
    nobody reads while the other job is waited for would stop its client once full): ``(the client's process,
    the submission id)``."""
    submission = f"{prefix}-{int(time.time())}"
    runtime_env = json.dumps({"env_vars": {"RAYRL_OUTPUT_ROOT": root}})
    cmd = [RAY, "job", "submit", "--address", ray_head["dashboard"], "--submission-id", submission,
           "--runtime-env-json", runtime_env, "--working-dir", ".", "--", sys.executable, *entrypoint]
    with open(os.path.join(root, "client.out"), "w") as out, open(os.path.join(root, "client.err"), "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=ray_head["env"], stdout=out, stderr=err), submission


@pytest.fixture(scope="module")
def submissions(ray_head, tmp_path_factory):
    """Both jobs submitted at once, each a driver of its own on the head: each waits on its driver's and its
    actors' starts, so the two together take less than one after the other (the module: 108 and 121 s, against
    135 and 132 one after the other here).
    ``{name: (process, submission id, output root)}``; a client still running at the end is killed."""
    jobs = {"default": (["-m", "cluster", "rl", "examples/configs/default.yaml", "--logging.out", "runs/job",
                         "--sft.steps", "30", "--algorithm.steps", "3", "--eval.every", "0",
                         "--data.task-kwargs", "num_heldout", "16", "--cluster.call-timeout-s", "300"], "rayrl-test"),
            "script": (["examples/custom_kl_ema.py", "--steps", "2", "--out", "runs/script"], "rayrl-script")}
    started = {}
    for name, (entrypoint, prefix) in jobs.items():
        root = str(tmp_path_factory.mktemp(f"submit_{name}"))
        started[name] = (*_submit(ray_head, root, entrypoint, prefix), root)
    yield started
    for proc, _, _ in started.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _ended(proc, root: str) -> str:
    """The client's output once its job has ended; it must have succeeded."""
    proc.wait(timeout=900)
    stdout, stderr = (open(os.path.join(root, name)).read() for name in ("client.out", "client.err"))
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


@pytest.mark.slow
def test_job_submit_runs_default_job(ray_head, submissions):
    """A relative --out, as the README's command gives, lands under $RAYRL_OUTPUT_ROOT - not in
    Ray's temporary copy of the working directory, which vanishes with the session."""
    proc, submission, root = submissions["default"]
    _ended(proc, root)
    out = os.path.join(root, "runs", "job")

    def job(*args):
        return subprocess.run([RAY, "job", *args, "--address", ray_head["dashboard"], submission], env=ray_head["env"],
                              capture_output=True, text=True, timeout=120).stdout

    assert "succeeded" in job("status").lower()
    logs = job("logs")
    assert "eval accuracy after grpo" in logs
    assert f"writing outputs to {out}" in logs and f"are in {out}" in logs  # the absolute path, start and end
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    # it joined the head it was submitted to (same GCS port), not a Ray of its own
    assert summary["ray_address"].rsplit(":", 1)[1] == ray_head["gcs"].rsplit(":", 1)[1]
    assert (summary["rl_steps"], summary["generators"], summary["trainer_ranks"], summary["zero_stage"]) == (3, 2, 2, 2)
    assert os.path.isfile(os.path.join(out, "final_model", "hf", "model.safetensors"))
    # the resolved config, overrides applied, is saved beside the outputs
    from cluster.jobs.config import RLJob, load_job_config

    saved = load_job_config(os.path.join(out, "config.yaml"), RLJob)
    assert saved.algorithm.steps == 3 and saved.data.task_kwargs == {"num_heldout": 16} and saved.logging.out == out


@pytest.mark.slow
def test_job_submit_of_a_script_writes_under_the_output_root(submissions):
    """A user's own script, submitted with `--working-dir .`: its relative --out goes through
    `primitives.io.outputs.output_dir` to $RAYRL_OUTPUT_ROOT, so the outputs outlive Ray's
    temporary copy of the working directory (which holds none of them)."""
    proc, _, root = submissions["script"]
    stdout = _ended(proc, root)
    out = os.path.join(root, "runs", "script")
    assert f"writing outputs to {out}" in stdout
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and set(summary["mean_over_steps"]["kl/ref_k3"]) == {"ema", "fixed"}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 4 and os.path.isfile(os.path.join(out, "curves.png"))
    assert not os.path.exists(os.path.join(ROOT, "runs", "script"))  # nothing in the checkout either
