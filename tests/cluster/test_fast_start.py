"""Fast start: the start-up stages the job reports, the actors' environment
without a runtime_env, and DeepSpeed on CPU without its shared-memory op."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from cluster.jobs.outputs import startup_figures
from cluster.ray_wing.roles import stage_seconds
from rl_actors.common import environ
from tests.conftest import ROOT


def test_stage_seconds_are_the_gaps_between_marks():
    marks = [("start", 100.0), ("ray_init", 102.5), ("actors", 110.0), ("weight_sync", 110.25)]
    assert stage_seconds(marks) == {"ray_init": 2.5, "actors": 7.5, "weight_sync": 0.25}


def test_startup_counts_every_stage_but_the_first_step():
    figures = startup_figures(process_start=10.0, run_start=11.5, cluster_start=14.0,
                              stages={"ray_init": 2.0, "actors": 5.0, "before_rl": 0.5, "first_step": 0.3})
    assert figures["startup"] == {"driver_start": 1.5, "prepare": 2.5, "ray_init": 2.0, "actors": 5.0,
                                  "before_rl": 0.5, "first_step": 0.3}
    assert figures["startup_s"] == 11.5  # 1.5 + 2.5 + 2 + 5 + 0.5: process start to ready for the first step


def test_environ_sets_values_inside_the_block_only(monkeypatch):
    monkeypatch.setenv("RAYRL_TEST_KEPT", "before")
    monkeypatch.delenv("RAYRL_TEST_NEW", raising=False)
    with environ({"RAYRL_TEST_KEPT": "inside", "RAYRL_TEST_NEW": "1"}):
        assert os.environ["RAYRL_TEST_KEPT"] == "inside" and os.environ["RAYRL_TEST_NEW"] == "1"
    assert os.environ["RAYRL_TEST_KEPT"] == "before" and "RAYRL_TEST_NEW" not in os.environ


ACTOR_ENV = """
import json, os, sys
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.placement import RoleSpec
from cluster.ray_wing.roles import start_ray
import ray
start_ray(ClusterConfig(), [RoleSpec("generator", 1, 1.0, 0.0)])
names = ("TQDM_DISABLE", "TOKENIZERS_PARALLELISM", "PYTHONPATH")
seen = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in names}).remote())
import cluster.ray_wing.groups  # importable in the worker: the checkout is on its path
ok = ray.get(ray.remote(lambda: __import__("cluster.ray_wing.groups").__name__).remote())
print("ENV", json.dumps({"actor": seen, "driver": {k: os.environ.get(k) for k in names}, "import": ok,
                         "runtime_env": ray.get_runtime_context().runtime_env}))
ray.shutdown()
"""


@pytest.mark.ray
def test_a_local_ray_gives_the_actors_their_environment_without_a_runtime_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TQDM_DISABLE", "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix="rr", dir="/tmp") as tmp:  # short: Ray's socket paths are bounded
        env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=tmp)
        proc = subprocess.run([sys.executable, "-c", ACTOR_ENV], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("ENV")).split(" ", 1)[1])
    assert seen["actor"]["TQDM_DISABLE"] == "1" and seen["actor"]["TOKENIZERS_PARALLELISM"] == "false"
    assert ROOT in seen["actor"]["PYTHONPATH"].split(os.pathsep) and seen["import"] == "cluster"
    assert seen["driver"] == {"TQDM_DISABLE": None, "TOKENIZERS_PARALLELISM": None, "PYTHONPATH": None}
    assert not seen["runtime_env"]  # the workers Ray starts ahead fit every actor


DEEPSPEED_PROBE = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from rl_actors.deepspeed_rank import import_muon_uncompiled, skip_shm_comm_op
skip_shm_comm_op()
from deepspeed.comm.torch import build_shm_op
print("SHM", build_shm_op())
import_muon_uncompiled()
from deepspeed.runtime.zero.muon import original_muon
print("INDUCTOR", "torch._inductor.compile_fx" in sys.modules, "DYNAMO_OFF", "TORCHDYNAMO_DISABLE" in os.environ,
      "PLAIN", type(original_muon.muon_update).__name__)
"""


def test_deepspeed_on_cpu_skips_the_shared_memory_op_and_muon_compilation():
    """The shared-memory op serves only tensor-parallel inference, the Muon kernels only the
    Muon optimizer; ZeRO-1/2/3 on CPU with AdamW run without either
    (tests/rl_actors/test_trainer_zero.py)."""
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SHM None" in proc.stdout
    assert "INDUCTOR False DYNAMO_OFF False PLAIN function" in proc.stdout


@pytest.mark.ray
def test_the_job_summary_reports_startup_seconds_by_stage(tmp_path):
    from cluster.jobs.cli import run

    summary = run(["rl", os.path.join(ROOT, "examples", "configs", "default.yaml"), "--sft.steps", "0",
                   "--algorithm.steps", "1", "--algorithm.prompts-per-step", "4", "--eval.enabled", "False",
                   "--cluster.trainers", "1", "--logging.out", str(tmp_path)])
    # the default job generates on its trainer ranks: 1 rank, 1 generator, whatever cluster.generators says
    assert (summary["generation"], summary["generators"], summary["trainer_ranks"]) == ("trainers", 1, 1)
    stages = summary["startup"]
    assert list(stages) == ["driver_start", "prepare", "ray_init", "actors_created", "actors_loaded",
                            "trainer_setup", "weight_sync", "before_rl", "first_step"]
    assert all(s >= 0 for s in stages.values()) and stages["first_step"] > 0
    assert abs(summary["startup_s"] - sum(s for k, s in stages.items() if k != "first_step")) < 0.02
    with open(tmp_path / "summary.json") as f:
        assert json.load(f)["startup"] == stages


REWARD_WITHOUT_TORCH = """
import sys
from ray import cloudpickle  # what Ray sends the actor
import numpy as np
from cluster.jobs.config import RLJob
from primitives.env.rewards import build_reward
from primitives.types import Rollout
from rl_actors.reward import RewardWorker
reward_fn, aggregate_fn, _ = build_reward(RLJob().rewards)  # the default job's exact_match
worker = RewardWorker(*cloudpickle.loads(cloudpickle.dumps((reward_fn, aggregate_fn))))
ids = np.arange(3)
rollouts = [Rollout("e0/i0/s" + str(k), "e0/i0", "1+2=", ids, ids, np.ones(3, np.float32), np.zeros(3, np.float32),
                    text=text, answer=3) for k, text in enumerate(["3", "4"])]
print("SCORED", [r.reward for r in worker.score(rollouts)], "torch" in sys.modules)
"""


def test_a_reward_worker_scores_plain_python_rewards_without_importing_torch():
    proc = subprocess.run([sys.executable, "-c", REWARD_WITHOUT_TORCH], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(x for x in proc.stdout.splitlines() if x.startswith("SCORED")) == "SCORED [1.0, 0.0] False"


def test_the_process_start_is_read_to_a_clock_tick():
    """startup_s counts from the process's start: read from /proc against the boot-time clock, it
    falls between the parent's spawn and the child's first line (psutil's create_time, whose boot
    time is in whole seconds, was up to 1 s early)."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", "import time; first = time.time(); "
                           "from cluster.jobs.outputs import process_start_time; print(first, process_start_time())"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, start = map(float, proc.stdout.split())
    assert spawned - 0.02 <= start <= first  # a clock tick (10 ms) of rounding, and some slack


@pytest.mark.parametrize("running", [False, True])
def test_a_script_shuts_down_only_the_ray_it_started(monkeypatch, running):
    """``ray_left_as_found`` (the examples' ``main``): a Ray the block started goes down with it,
    on an error too; one running before it (a notebook's, the test run's) stays up."""
    import ray

    from cluster.ray_wing.roles import ray_left_as_found

    shutdowns, state = [], {"up": running}
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    with pytest.raises(RuntimeError, match="in the block"):
        with ray_left_as_found():
            state["up"] = True  # the block started Ray (or joined the running one)
            raise RuntimeError("in the block")
    state["up"] = running
    with ray_left_as_found():
        state["up"] = True
    assert len(shutdowns) == (0 if running else 2)  # decided by whether Ray ran before the block
