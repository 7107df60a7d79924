"""The card's shape through ``rayrl rl``: the shipped configs that run generator workers (and,
for the KubeRay job, reference workers) apart from the trainers, each for 2 steps as shipped -
only what a CPU cannot do is overridden (GPUs, the node-group pins) and the sizes that would
take minutes here (prompts per step, completion length, evaluation). Each run must generate on
its workers, send them the weights after every step, and sample the trainers' policy.

The KubeRay job runs the embedded tiny model in its shipped bfloat16, not SmolLM2: six SmolLM2
copies in bf16 (2 generators, 2 trainer ranks, 2 reference workers) took 87 s here for two steps of
about 19 s each, for nothing the config's wiring needs (issue 32). SmolLM2 runs as shipped in
``smollm2_arithmetic.yaml`` below and in ``test_vllm_jobs``; this stays the one whole job in bf16.
``own_data.yaml`` is run as shipped, with vLLM generating, by ``test_vllm_jobs`` (its chat job), which
checks the same for each of its steps."""
import json
import os

import pytest
import yaml

from tests.conftest import ROOT, run_job

CONFIGS = os.path.join(ROOT, "examples", "configs")
# no snapshots either: a SmolLM2 snapshot takes about 15 s here, and the fault tests hold them
PROMPTS = 2
SHORT = ["--algorithm.steps", "2", "--algorithm.prompts-per-step", str(PROMPTS), "--generation.max-new-tokens", "8",
         "--eval.max-items", "8", "--eval.final-pass-k", "0", "--checkpoint.every", "0",
         "--cluster.snapshot-every", "0"]


def _k8s_job(tmp_path) -> tuple:
    """The ConfigMap's job.yaml as a file, and what a CPU machine must override in it."""
    with open(os.path.join(ROOT, "k8s", "job-config.yaml")) as f:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_load(f)["data"]["job.yaml"])
    return str(path), ["--cluster.generator-gpus", "0", "--cluster.trainer-gpus", "0", "--cluster.pin-roles", "False",
                       "--model.model-name-or-path", "tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2_arithmetic", "k8s"])
def test_shipped_separate_worker_configs_run_two_steps(name, tmp_path):
    from cluster.jobs.config import load_job_config

    if name == "k8s":
        path, cpu = _k8s_job(tmp_path)
    else:
        path, cpu = os.path.join(CONFIGS, f"{name}.yaml"), []
    shipped = load_job_config(path)
    out = str(tmp_path / "run")
    summary = run_job(["rl", path, "--logging.out", out, *SHORT, *cpu])
    assert summary["rl_steps"] == 2 and summary["generation"] == "workers"
    assert summary["generators"] == shipped.cluster.generators and summary["trainer_ranks"] == shipped.cluster.trainers
    uses_reference = (shipped.algorithm.kl_coef or 0) > 0
    assert summary["reference"] == ("workers" if uses_reference else None)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["time/sync"] > 0 and r["sync/bytes"] > 0  # the weights went to the generator workers after the step
        assert r["batch/rows"] == PROMPTS * shipped.generation.group_size
        # the generators sampled the weights the trainers hold: their logprobs agree (to bf16's rounding in
        # the k8s job: the tiny model's tokens differed by at most 0.0054 nat here, the mean k3 was 1.7e-6)
        if shipped.model.dtype == "bfloat16":
            assert r["mismatch/k3"] < 1e-4 and r["mismatch/max_abs_logp_diff"] < 0.05, r
        else:
            assert r["mismatch/max_abs_logp_diff"] < 1e-3, r
        if uses_reference:
            assert "kl/ref_k3" in r and r["time/ref"] > 0  # the reference workers scored the rollouts
