"""benchmarks/gpu_check.py as CI runs it, on the CPU (no GPU here): it drives a trainer rank
that hosts its generator where neither Ray nor vLLM can be imported, and on fp32 CPU every gap it measures is the parity
invariant's (< 1e-4), its step equals the one-process step, and it appends a dated table."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = """
import json, sys
sys.modules["ray"] = sys.modules["vllm"] = None  # as on a lent GPU machine: importing either fails
sys.path.insert(0, "benchmarks")
import gpu_check
fig = gpu_check.main(["--prompts", "4", "--group", "3", "--max-new-tokens", "6", "--write", sys.argv[1], *sys.argv[2:]])
print("FIGURES", json.dumps(fig))
"""


@pytest.mark.no_ray
@pytest.mark.slow  # a DeepSpeed rank's RL step in a subprocess (11-14 s each): the full suite's, not the edit loop's
@pytest.mark.parametrize("lora", [0, 4])
def test_gpu_check_runs_on_the_cpu_without_ray(tmp_path, lora):
    """Full fine-tuning, and LoRA adapters (rank 4) with the reference as the base model (adapters off)."""
    out = tmp_path / "benchmarks.md"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TQDM_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), "--lora", str(lora)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((tmp_path / "tmp").glob("gpu_check_*"))  # its model's directory went with it
    fig = json.loads(proc.stdout.split("FIGURES", 1)[1])
    assert fig["bf16"] is False and fig["sampler_device"] == "cpu"
    assert fig["rollouts"] == 12 and fig["tokens"] > 0
    assert fig["behaviour_vs_fp32_max"] < 1e-4 and fig["trainer_vs_fp32_max"] < 1e-4
    assert fig["mismatch/max_abs_logp_diff"] < 1e-4 and fig["mismatch/is_clipped_frac"] == 0.0
    assert fig["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert fig["grad_norm"] > 0 and fig["grad_norm"] == pytest.approx(fig["grad_norm fp32 cpu"], rel=1e-5)
    assert fig["loss/policy"] == pytest.approx(fig["loss/policy fp32 cpu"], abs=1e-6)
    assert fig["update_cosine_vs_fp32_cpu"] > 0.9999
    # the snapshot a rebuilt group restores: exact, and the step made again gives the same weights
    assert fig["snapshot_mb"] > 0 and fig["restored_vs_snapshot_max"] == 0.0
    assert fig["step_again_vs_first_max"] == 0.0
    if lora:  # the reference on the rank is the base model: its logprobs are the fp32 CPU model's
        assert "LoRA rank 4" in fig["model"] and fig["reference_vs_fp32_base_max"] < 1e-4
    text = out.read_text()
    assert text.startswith(f"\n### GPU check ({fig['date']}, cpu") and "| mismatch/is_clipped_frac | 0 |" in text
